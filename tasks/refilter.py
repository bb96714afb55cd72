"""Re-filtering and re-verification: a committed trajectory version + an SQL predicate -> a derived version.

``rlrounds refilter`` selects rows (optionally regrouped); ``rlrounds reverify`` keeps every row but
runs the verifier again on the selected ones (by default the infrastructure failures, once the
environment is fixed), records the new verdicts and the verifier's name and version on them, and
judges the groups holding them again. Both commit derived versions that replay can train on.

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

from pydantic import BaseModel, ConfigDict, Field

from tasks.filter import FilterConfig, apply_decisions, decide, filter_stats

DERIVED_KIND = "derived"


class RefilterRequest(BaseModel):
    """Which version to re-filter, and how."""

    model_config = ConfigDict(extra="forbid")

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

def run_refilter(storage: str, request: RefilterRequest) -> dict:
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
    return {"version": manifest.version, "uri": manifest.directory, "parent": parent.version, "stats": stats}


# -- re-verification ---------------------------------------------------------------------------------

REVERIFY_DEFAULT_WHERE = "outcome = 'infra_failure'"


class ReverifyRequest(BaseModel):
    """Which rows of a version to score again, once the environment that failed them is fixed."""

    model_config = ConfigDict(extra="forbid")

    version: str
    """Trajectory version id (or a unique prefix of at least 6 characters)."""
    where: str = REVERIFY_DEFAULT_WHERE
    """DuckDB SQL predicate choosing the rows to verify again; default: the infrastructure failures."""
    verifier: str | None = None
    """Verifier to run. Default: the one recorded on the rows (one name per version)."""
    workers: int = Field(2, ge=1, le=256)
    """Verifier threads."""
    infra_retries: int = Field(2, ge=0, le=10)
    """Extra attempts per row after an infrastructure failure."""


def reverified_rows(rows: list[dict], chosen: set[tuple[str, int]], verdicts: dict, verifier: dict,
                    config: FilterConfig) -> list[dict]:
    """Rows with the chosen ones' verdicts replaced and the groups holding them judged again.

    ``verdicts``: (group_id, sample_index) -> (Verdict, verified_at). Groups without a re-verified row
    keep their advantages and kept/drop decisions exactly; a touched group is re-decided by the
    round's filter rules (an infra failure now scored may give it signal, or a success may vanish)."""
    updated = []
    for row in rows:
        key = (row["group_id"], row["sample_index"])
        if key in chosen:
            verdict, verified_at = verdicts[key]
            row = {**row, "reward": verdict.reward, "outcome": verdict.outcome.value, "verify_error": verdict.error,
                   "verifier": verifier, "verified_at": verified_at, "verify_latency_s": verdict.latency_s}
        updated.append(row)
    touched = {group for group, _ in chosen}
    regrouped = iter(apply_decisions([r for r in updated if r["group_id"] in touched],
                                     decide([r for r in updated if r["group_id"] in touched], config), None))
    return [next(regrouped) if r["group_id"] in touched else r for r in updated]


def run_reverify(storage: str, request: ReverifyRequest) -> dict:
    """Verify the selected rows again and commit a derived version carrying the new verdicts."""
    from collections import Counter
    from datetime import datetime, timezone

    from storage.paths import StorageRoot
    from storage.query import select_rows
    from storage.trajectories import find_version, parent_chain, read_table, rows_to_table, write_version
    from tasks.verify import VERIFIER_VERSIONS, VerifierPool, get_verifier

    root = StorageRoot.of(storage)
    parent = find_version(root, request.version)
    table = read_table(root, parent).drop_columns(["trajectory_version"])
    chosen_rows = select_rows(table, request.where).to_pylist()
    recorded = sorted({(r["verifier"] or {}).get("name") for r in chosen_rows} - {None})
    name = request.verifier or (recorded[0] if len(recorded) == 1 else None)
    if name is None:
        raise ValueError(f"the selected rows of {parent.version} name {len(recorded)} verifiers ({recorded}); "
                         "pass --verifier NAME")
    verifier = get_verifier(name)
    identity = {"name": name, "version": VERIFIER_VERSIONS.get(name, "unknown")}
    with VerifierPool(verifier, request.workers, request.infra_retries, 64 * request.infra_retries + 64) as pool:
        futures = {(r["group_id"], r["sample_index"]): pool.submit(r["completion_text"], r["reference"]) for r in chosen_rows}
        verdicts = {key: (f.result(), datetime.now(timezone.utc)) for key, f in futures.items()}
    config = recorded_filter(parent_chain(root, parent))
    rows = reverified_rows(table.to_pylist(), set(verdicts), verdicts, identity, config)
    before = Counter(r["outcome"] for r in chosen_rows)
    after = Counter(v.outcome.value for v, _ in verdicts.values())
    meta = {
        "kind": DERIVED_KIND,
        "run_id": parent.body.get("run_id"),
        "round": parent.body.get("round"),
        "parent": parent.version,
        "derivation": {
            "reverify": {"where": request.where, "verifier": identity, "rows": len(chosen_rows),
                         "outcomes_before": dict(before), "outcomes_after": dict(after)},
            "filter": config.model_dump(mode="json"),
            "parent_rows": table.num_rows,
        },
    }
    derived = rows_to_table(rows)
    manifest = write_version(root, root.derived_version, derived, meta)
    stats = filter_stats(derived.select(["group_id", "kept", "drop_reason"]).to_pylist())
    return {"version": manifest.version, "uri": manifest.directory, "parent": parent.version, "rows": len(chosen_rows),
            "verifier": identity, "outcomes_before": dict(before), "outcomes_after": dict(after), "stats": stats}


from prefect import task  # noqa: E402 -- the thin Prefect wrapper stays at the bottom
from prefect.cache_policies import NO_CACHE  # noqa: E402

refilter_task = task(name="refilter", cache_policy=NO_CACHE)(run_refilter)
