"""Re-filtering and re-verification: a committed trajectory version + an SQL predicate -> a derived version.

``rlrounds refilter`` selects rows (optionally regrouped); ``rlrounds reverify`` keeps every row but
runs the verifier again on the selected ones (by default the infrastructure failures, once the
environment is fixed), records the new verdicts and the verifier's name and version on them, and
judges the groups holding them again. Both commit derived versions that replay can train on.

The predicate selects rows (DuckDB over the verified parts, storage/query.py). Without regrouping the
selected rows keep their advantages and kept/drop decisions, exactly as the round stored them. With
regrouping they are judged again by the round's own rules (tasks/filter/stage.py): advantages are
recomputed over the samples left in each group, and a group whose survivors all scored the same is
dropped as zero-variance.

The derived version lives under ``<root>/derived/<version>/``; its manifest records the parent version
and the derivation (predicate, regroup, filter rules). Its id hashes its rows and that derivation, so
the same parent and predicate always give the same version, and running it again rewrites nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from datetime import UTC, datetime

import pyarrow as pa

from storage.paths import StorageRoot
from storage.query import select_rows
from storage.trajectories import Manifest, find_version, parent_chain, read_table, rows_to_table, write_version
from tasks.config.filter import FilterConfig
from tasks.config.refilter import RefilterRequest, ReverifyRequest
from tasks.filter.history import history_baselines
from tasks.filter.stage import DECISION_INPUTS, apply_decisions, decide, filter_stats, with_decisions
from tasks.round.results import Reverified, TrajectoryVersion
from tasks.verifiers.pool import VerifierPool
from tasks.verifiers.registry import get_verifier, verifier_version

DERIVED_KIND = "derived"


def regroup_rows(
    rows: list[dict],
    config: FilterConfig,
    target_groups: int | None,
    policy_version: int | None = None,
    baselines: Mapping[str, float] | None = None,
) -> list[dict]:
    """Judge rows again as a round would: per-group advantages, kept flags and drop reasons.
    ``policy_version``: the policy the rows train (for filter.max_staleness; None: no bound); ``baselines``:
    prompts' success rates in the history (filter.history_baseline_rounds; ``recorded_baselines``)."""
    return apply_decisions(rows, decide(rows, config, policy_version, baselines), target_groups)


def recorded_policy_version(chain) -> int | None:
    """The policy version the rollout version at the root of a derivation chain was filtered for."""
    return chain[-1].derivation.get("policy_version")


def recorded_baselines(root: StorageRoot, chain, config: FilterConfig) -> Mapping[str, float] | None:
    """The history baselines of the rollout version at the root of a derivation chain, as its round read them:
    the campaign's committed versions before that round (None when ``config`` sets none)."""
    rollout = chain[-1].body
    return history_baselines(root, rollout.get("run_id"), rollout.get("round"), config.history_baseline_rounds)


def recorded_filter(chain) -> FilterConfig:
    """The filter rules of the rollout version at the root of a derivation chain (defaults if none)."""
    recorded = chain[-1].derivation.get("filter")
    return FilterConfig.model_validate(recorded) if recorded else FilterConfig()


# -- the stage ------------------------------------------------------------------------------------


def run_refilter(*, storage: str, request: RefilterRequest) -> TrajectoryVersion:
    """Select, optionally regroup, and commit the derived version; returns its id, URI and statistics."""
    root, parent, table = read_parent(storage, request.version)
    selected = select_rows(table, request.where)
    config = None
    if request.regroup:
        chain = parent_chain(root, parent)
        config = request.filter or recorded_filter(chain)
        # decisions read a few light columns; the heavy ones (texts, logprobs) stay in Arrow, untouched
        judged = regroup_rows(
            selected.select(DECISION_INPUTS).to_pylist(),
            config,
            request.target_groups,
            recorded_policy_version(chain),
            recorded_baselines(root, chain, config),
        )
        selected = with_decisions(selected, judged)
    derivation = {
        "where": request.where,
        "regroup": request.regroup,
        "filter": config.model_dump(mode="json") if config else None,
        "target_groups": request.target_groups if request.regroup else None,
        "parent_rows": table.num_rows,
    }
    return commit_derived(root, parent, selected, derivation)


def read_parent(storage: str, version: str) -> tuple[StorageRoot, Manifest, pa.Table]:
    """The storage root, the manifest of the version a derivation starts from, and its rows (without
    the version column: the derived version gets its own)."""
    root = StorageRoot.of(storage)
    parent = find_version(root, version)
    return root, parent, read_table(root, parent).drop_columns(["trajectory_version"])


def commit_derived(root: StorageRoot, parent: Manifest, rows: pa.Table, derivation: dict) -> TrajectoryVersion:
    """Commit ``rows`` as a version derived from ``parent`` by ``derivation``. Its manifest keeps the
    parent's run and round, so a derived version still says which rollout its rows came from."""
    meta = {
        "kind": DERIVED_KIND,
        "run_id": parent.body.get("run_id"),
        "round": parent.body.get("round"),
        "parent": parent.version,
        "derivation": derivation,
    }
    manifest = write_version(root, root.derived_version, rows, meta)
    stats = filter_stats(rows.select(["group_id", "kept", "drop_reason", "reward"]).to_pylist())
    return TrajectoryVersion(version=manifest.version, uri=manifest.directory, parent=parent.version, stats=stats)


# -- re-verification ---------------------------------------------------------------------------------


def reverified_rows(
    rows: list[dict],
    chosen: set[tuple[str, int]],
    verdicts: dict,
    verifier: dict,
    config: FilterConfig,
    policy_version: int | None = None,
    baselines: Mapping[str, float] | None = None,
) -> list[dict]:
    """Rows with the chosen ones' verdicts replaced and the groups holding them judged again.

    ``verdicts``: (group_id, sample_index) -> (Verdict, verified_at). Groups without a re-verified row
    keep their advantages and kept/drop decisions exactly; a touched group is re-decided by the
    round's filter rules (an infra failure now scored may give it signal, or a success may vanish)."""
    updated = []
    for row in rows:
        key = (row["group_id"], row["sample_index"])
        if key in chosen:
            verdict, verified_at = verdicts[key]
            row = {
                **row,
                "reward": verdict.reward,
                "outcome": verdict.outcome.value,
                "verify_error": verdict.error,
                "verifier": verifier,
                "verified_at": verified_at,
                "verify_latency_s": verdict.latency_s,
            }
        updated.append(row)
    touched = {group for group, _ in chosen}
    in_touched = [r for r in updated if r["group_id"] in touched]
    regrouped = iter(apply_decisions(in_touched, decide(in_touched, config, policy_version, baselines), None))
    return [next(regrouped) if r["group_id"] in touched else r for r in updated]


def run_reverify(*, storage: str, request: ReverifyRequest) -> Reverified:
    """Verify the selected rows again and commit a derived version carrying the new verdicts."""
    root, parent, table = read_parent(storage, request.version)
    chosen_rows = select_rows(table, request.where).to_pylist()
    recorded = sorted({(r["verifier"] or {}).get("name") for r in chosen_rows} - {None})
    name = request.verify.verifier or (recorded[0] if len(recorded) == 1 else None)
    if name is None:
        raise ValueError(
            f"the selected rows of {parent.version} name {len(recorded)} verifiers ({recorded}); pass --verifier NAME"
        )
    verify = request.verify.model_copy(update={"verifier": name})
    identity = {"name": name, "version": verifier_version(name)}
    with VerifierPool(
        get_verifier(name, verify), verify.workers, verify.infra_retries, verify.infra_retry_budget, verify.timeout_s
    ) as pool:
        futures = {
            (r["group_id"], r["sample_index"]): pool.submit(r["completion_text"], r["reference"]) for r in chosen_rows
        }
        verdicts = {key: (f.result(), datetime.now(UTC)) for key, f in futures.items()}
    chain = parent_chain(root, parent)
    config = recorded_filter(chain)
    rows = reverified_rows(
        table.to_pylist(),
        set(verdicts),
        verdicts,
        identity,
        config,
        recorded_policy_version(chain),
        recorded_baselines(root, chain, config),
    )
    before = dict(Counter(r["outcome"] for r in chosen_rows))
    after = dict(Counter(v.outcome.value for v, _ in verdicts.values()))
    derivation = {
        "reverify": {
            "where": request.where,
            "verifier": identity,
            "rows": len(chosen_rows),
            "outcomes_before": before,
            "outcomes_after": after,
        },
        "filter": config.model_dump(mode="json"),
        "parent_rows": table.num_rows,
    }
    derived = commit_derived(root, parent, rows_to_table(rows), derivation)
    return Reverified(
        **derived.model_dump(),
        rows=len(chosen_rows),
        verifier=identity,
        outcomes_before=before,
        outcomes_after=after,
    )
