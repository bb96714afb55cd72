"""Re-filtering: a committed trajectory version + an SQL predicate (optionally regrouped) -> a derived version.

The predicate selects rows (DuckDB over the verified parts, storage/query.py). Without regrouping the
selected rows keep their advantages and kept/drop decisions, exactly as the round stored them. With
regrouping they are judged again by the round's own rules (tasks/filter.py): advantages are
recomputed over the samples left in each group, and a group whose survivors all scored the same is
dropped as zero-variance.

The derived version lives under ``<root>/derived/<version>/``; its manifest records the parent version
and the derivation (predicate, regroup, filter rules). Its id hashes its rows and that derivation, so
the same parent and predicate always give the same version, and running it again rewrites nothing.
"""

from __future__ import annotations

from pydantic import Field

from tasks.config_base import Config
from tasks.filter import FilterConfig, apply_decisions, decide, filter_stats
from tasks.results import TrajectoryVersion

DERIVED_KIND = "derived"


class RefilterRequest(Config):
    """Which version to re-filter, and how."""

    version: str
    """Trajectory version id (or a unique prefix of at least 6 characters) to select rows from."""
    where: str
    """DuckDB SQL predicate over the trajectory columns, e.g.
    "len(completion_token_ids) <= 4 AND outcome <> 'infra_failure'"."""
    regroup: bool = False
    """Recompute advantages over the rows left in each group and re-drop groups without signal."""
    filter: FilterConfig | None = None
    """Rules for regrouping. Default: the rules recorded by the round that produced the rows."""
    target_groups: int | None = Field(None, ge=1)
    """With regroup: keep only the first N trainable groups (later ones are marked batch_full). Default: all."""


def regroup_rows(rows: list[dict], config: FilterConfig, target_groups: int | None) -> list[dict]:
    """Judge rows again as a round would: per-group advantages, kept flags and drop reasons."""
    return apply_decisions(rows, decide(rows, config), target_groups)


def recorded_filter(chain) -> FilterConfig:
    """The filter rules of the rollout version at the root of a derivation chain (defaults if none)."""
    recorded = chain[-1].derivation.get("filter")
    return FilterConfig.model_validate(recorded) if recorded else FilterConfig()


# -- the stage ------------------------------------------------------------------------------------

def run_refilter(*, storage: str, request: RefilterRequest) -> TrajectoryVersion:
    """Select, optionally regroup, and commit the derived version; returns its id, URI and statistics."""
    from storage.paths import StorageRoot
    from storage.query import select_rows
    from storage.trajectories import find_version, parent_chain, read_table, rows_to_table, write_version

    root = StorageRoot.of(storage)
    parent = find_version(root, request.version)
    table = read_table(root, parent).drop_columns(["trajectory_version"])
    selected = select_rows(table, request.where)
    config = None
    if request.regroup:
        config = request.filter or recorded_filter(parent_chain(root, parent))
        selected = rows_to_table(regroup_rows(selected.to_pylist(), config, request.target_groups))
    meta = {
        "kind": DERIVED_KIND,
        "run_id": parent.body.get("run_id"),
        "round": parent.body.get("round"),
        "parent": parent.version,
        "derivation": {
            "where": request.where,
            "regroup": request.regroup,
            "filter": config.model_dump(mode="json") if config else None,
            "target_groups": request.target_groups if request.regroup else None,
            "parent_rows": table.num_rows,
        },
    }
    manifest = write_version(root, root.derived_version, selected, meta)
    stats = filter_stats(selected.select(["group_id", "kept", "drop_reason"]).to_pylist())
    return TrajectoryVersion(version=manifest.version, uri=manifest.directory, parent=parent.version, stats=stats)
