"""Filtering: group-normalised advantages and the rules that decide which samples train.

Pure functions over plain rows first; the stage at the bottom only moves data in and out of the
trajectory store. Every dropped row keeps its ``drop_reason``.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated

import pyarrow as pa

from storage.paths import CARRYOVER, StorageRoot
from storage.trajectories import (
    TrajectoryStoreError,
    arrow_schema,
    clear_staging,
    committed_round_version,
    missing_staged,
    policy_token_count,
    read_staged,
    read_staged_carryover,
    read_table,
    sampled_versions,
    write_version,
)
from tasks.config.base import NotInput
from tasks.config.filter import FilterConfig
from tasks.filter.history import history_baselines
from tasks.round.context import RoundContext
from tasks.round.results import Stats, TrajectoryVersion
from tasks.verifiers.outcome import Outcome

DROP_INFRA = "infra_failure"  # the environment failed: never a zero reward in the gradient
DROP_UNKNOWN = "unscored"  # the verifier could not score it
DROP_ZERO_VARIANCE = "zero_variance_group"  # every sample of the group scored the same: no signal
DROP_INCOMPLETE = "incomplete_group"  # too few scored samples left in the group to compare
DROP_OVERFLOW = "batch_full"  # a complete group that arrived after the trainable batch was full
DROP_STALE = "stale"  # its oldest token lags the trained policy by more than filter.max_staleness versions
DROP_OVERLONG = "overlong"  # cut at the sampling limit, with filter.overlong = 'drop'
DROP_DOWN_SAMPLED = "down_sampled"  # left out of a group's most varied filter.keep_samples samples


@dataclass
class FilterDecision:
    advantage: float
    kept: bool
    drop_reason: str | None


def group_advantages(rewards: list[float], normalize_std: bool, epsilon: float) -> list[float]:
    """(r - mean) / (std + eps) within one group; population std, as in GRPO."""
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not normalize_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / (std + epsilon) for c in centred]


def history_advantages(rewards: list[float], baseline: float, normalize_std: bool, epsilon: float) -> list[float]:
    """A group that all scored the same, against its prompt's success rate in the campaign's history (a Bernoulli
    mean ``p``): r - p, divided by the rate's spread sqrt(p (1 - p)) when normalising (tasks/filter/history.py)."""
    centred = [r - baseline for r in rewards]
    if not normalize_std:
        return centred
    spread = math.sqrt(baseline * (1.0 - baseline))
    return [c / (spread + epsilon) for c in centred]


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to max_tokens - buffer, then linear down to -1 at max_tokens."""
    start = max_tokens - buffer
    return 0.0 if length <= start else max(-1.0, (start - length) / buffer)


def _sample_rule(row: dict, config: FilterConfig, policy_version: int | None) -> str | None:
    """Why a scored sample leaves its group before advantages are computed (None: it stays)."""
    sampled = sampled_versions(row.get("token_policy_versions"))
    if config.max_staleness is not None and policy_version is not None and sampled:
        if policy_version - min(sampled) > config.max_staleness:
            return DROP_STALE
    if config.overlong == "drop" and row.get("finish_reason") == "length":
        return DROP_OVERLONG
    return None


def shaped_reward(row: dict, config: FilterConfig) -> float:
    """The reward advantages are computed from: the verifier's, plus the overlong penalty when on."""
    if config.overlong != "penalty":
        return row["reward"]
    max_tokens = (row.get("sampling") or {}).get("max_tokens")
    if not max_tokens:
        return row["reward"]
    return row["reward"] + overlong_penalty(policy_token_count(row), max_tokens, config.overlong_buffer)


def decide(
    rows: Iterable[dict],
    config: FilterConfig,
    policy_version: int | None = None,
    baselines: Mapping[str, float] | None = None,
) -> dict[tuple[str, int], FilterDecision]:
    """Decide every row of a set of groups. Rows need group_id, sample_index, reward, outcome (and
    token_policy_versions, finish_reason, completion_token_ids, sampling for the staleness and
    overlong rules; prompt_id with ``baselines``). ``policy_version``: the version of the policy being trained
    (the round's parent); None turns the staleness bound off. ``baselines``: prompt id -> its success rate in the
    campaign's history (filter.history_baseline_rounds); a group that all scored the same on a prompt whose rate
    lies strictly between 0 and 1 trains against that rate instead of being dropped.

    Infrastructure failures, unscored, stale and (by config) overlong samples leave their group; the
    group's advantages are computed over the samples that remain, so a sandbox crash can never count
    as a wrong answer.
    """
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        groups[row["group_id"]].append(row)
    out: dict[tuple[str, int], FilterDecision] = {}
    for group_id, members in groups.items():
        scored = []
        for row in members:
            key = (group_id, row["sample_index"])
            if row["outcome"] == Outcome.INFRA_FAILURE.value:
                out[key] = FilterDecision(0.0, False, DROP_INFRA)
            elif row["reward"] is None or row["outcome"] == Outcome.UNKNOWN.value:
                out[key] = FilterDecision(0.0, False, DROP_UNKNOWN)
            elif (rule := _sample_rule(row, config, policy_version)) is not None:
                out[key] = FilterDecision(0.0, False, rule)
            else:
                scored.append(row)
        rewards = [shaped_reward(r, config) for r in scored]
        if config.keep_samples is not None and len(scored) > config.keep_samples and len(set(rewards)) > 1:
            chosen = set(most_varied(rewards, [r["sample_index"] for r in scored], config.keep_samples))
            for index, row in enumerate(scored):
                if index not in chosen:
                    out[(group_id, row["sample_index"])] = FilterDecision(0.0, False, DROP_DOWN_SAMPLED)
            scored = [row for index, row in enumerate(scored) if index in chosen]
            rewards = [reward for index, reward in enumerate(rewards) if index in chosen]
        uniform = len(set(rewards)) == 1  # every scored sample the same: no signal within the group
        rate = baselines.get(scored[0]["prompt_id"]) if baselines and uniform else None
        baseline = rate if rate is not None and 0.0 < rate < 1.0 else None
        if len(scored) < config.min_scored_per_group:
            reason = DROP_INCOMPLETE
        elif config.drop_zero_variance and uniform and baseline is None:
            reason = DROP_ZERO_VARIANCE
        else:
            reason = None
        if baseline is not None:
            advantages = history_advantages(rewards, baseline, config.normalize_std, config.epsilon)
        else:
            advantages = group_advantages(rewards, config.normalize_std, config.epsilon) if scored else []
        for row, adv in zip(scored, advantages):
            out[(group_id, row["sample_index"])] = FilterDecision(
                adv if reason is None else 0.0, reason is None, reason
            )
    return out


def most_varied(rewards: list[float], order: list[int], keep: int) -> list[int]:
    """Positions of the ``keep`` rewards whose population variance is largest: for some i, the i highest and the
    ``keep - i`` lowest (a subset of largest variance always has that form), i as near ``keep / 2`` as the
    variance allows; among equal rewards the lower ``order`` (sample index) first. In position order."""
    high = sorted(range(len(rewards)), key=lambda p: (-rewards[p], order[p]))
    low = sorted(range(len(rewards)), key=lambda p: (rewards[p], order[p]))
    best, best_spread = None, -1.0
    for i in sorted(range(keep + 1), key=lambda i: (abs(2 * i - keep), i)):
        top = high[:i]
        subset = top + [p for p in low if p not in top][: keep - i]
        mean = sum(rewards[p] for p in subset) / keep
        spread = sum((rewards[p] - mean) ** 2 for p in subset)
        if spread > best_spread + 1e-12:
            best, best_spread = subset, spread
    return sorted(best)


def group_is_trainable(
    rows: list[dict],
    config: FilterConfig,
    policy_version: int | None = None,
    baselines: Mapping[str, float] | None = None,
) -> bool:
    """Would this group survive filtering? Used by rollout to know when the trainable batch is full.
    ``rows``: its samples, with the fields ``decide`` reads."""
    return any(d.kept for d in decide(rows, config, policy_version, baselines).values())


def apply_decisions(
    rows: list[dict], decisions: dict[tuple[str, int], FilterDecision], target_groups: int | None
) -> list[dict]:
    """Write advantage/kept/drop_reason into rows; only the first ``target_groups`` trainable groups
    (in completion order) are kept, later ones are marked ``batch_full``."""
    taken: set[str] = set()
    out = []
    for row in rows:
        d = decisions[(row["group_id"], row["sample_index"])]
        kept, reason = d.kept, d.drop_reason
        if kept and row["group_id"] not in taken:
            if target_groups is not None and len(taken) >= target_groups:
                kept, reason = False, DROP_OVERFLOW
            else:
                taken.add(row["group_id"])
        out.append({**row, "advantage": d.advantage, "kept": kept, "drop_reason": reason})
    return out


def length_bias(rows: list[dict]) -> dict[str, float]:
    """Which completion lengths training sees, against what was generated: rows are split into (up to)
    four buckets at the quartiles of the stored completion lengths; per bucket, its share of the generated
    samples and of the kept ones. Keeping only early finishers shows as a long bucket kept less than
    generated; ``filter/length_bias`` is mean kept length over mean generated length (1: none)."""
    lengths = sorted(len(r["completion_token_ids"]) for r in rows)
    kept = [len(r["completion_token_ids"]) for r in rows if r["kept"]]
    if not lengths:
        return {}
    # Quartile edges; fewer buckets when lengths repeat (a bucket is never empty of generated samples).
    edges = sorted({lengths[max(0, len(lengths) * q // 4 - 1)] for q in (1, 2, 3)} | {lengths[-1]})
    stats: dict[str, float] = {}
    lower = -1
    for q, upper in enumerate(edges, start=1):
        stats[f"filter/length_q{q}_max_tokens"] = upper
        stats[f"filter/length_q{q}_generated_share"] = sum(lower < n <= upper for n in lengths) / len(lengths)
        stats[f"filter/length_q{q}_kept_share"] = sum(lower < n <= upper for n in kept) / max(len(kept), 1)
        lower = max(lower, upper)
    stats["filter/generated_mean_tokens"] = sum(lengths) / len(lengths)
    stats["filter/kept_mean_tokens"] = sum(kept) / max(len(kept), 1)
    stats["filter/length_bias"] = stats["filter/kept_mean_tokens"] / max(stats["filter/generated_mean_tokens"], 1e-9)
    return stats


def filter_stats(rows: list[dict]) -> dict[str, float]:
    reasons = Counter(r["drop_reason"] for r in rows if not r["kept"])
    kept_groups = {r["group_id"] for r in rows if r["kept"]}
    stats = {
        "filter/rows": len(rows),
        "filter/kept_rows": sum(1 for r in rows if r["kept"]),
        "filter/kept_groups": len(kept_groups),
        "filter/groups": len({r["group_id"] for r in rows}),
    }
    for reason in (
        DROP_INFRA,
        DROP_UNKNOWN,
        DROP_ZERO_VARIANCE,
        DROP_INCOMPLETE,
        DROP_OVERFLOW,
        DROP_STALE,
        DROP_OVERLONG,
        DROP_DOWN_SAMPLED,
    ):
        stats[f"filter/dropped_{reason}"] = reasons.get(reason, 0)
    if rows and "completion_token_ids" in rows[0]:
        stats.update(length_bias(rows))
    stats["filter/kept_rows_spanning_versions"] = sum(
        1 for r in rows if r["kept"] and len(set(sampled_versions(r.get("token_policy_versions")))) > 1
    )
    if rows and "reward" in rows[0]:
        # kept groups whose samples all scored the same: trained against their prompt's history rate
        # (filter.history_baseline_rounds), or kept at zero advantage with filter.drop_zero_variance off
        rewards: dict[str, set] = defaultdict(set)
        for r in rows:
            if r["kept"]:
                rewards[r["group_id"]].add(r["reward"])
        stats["filter/kept_uniform_groups"] = sum(1 for scored in rewards.values() if len(scored) == 1)
    return stats


# -- the stage ------------------------------------------------------------------------------------

DECISION_INPUTS = (
    "group_id",
    "prompt_id",
    "sample_index",
    "reward",
    "outcome",
    "token_policy_versions",
    "finish_reason",
    "completion_token_ids",
    "turns",
    "sampling",
)
"""The columns ``decide``, ``apply_decisions`` and ``filter_stats`` read."""


def with_decisions(table, rows: list[dict]):
    """``table`` with its advantage, kept and drop_reason columns taken from ``rows`` (same order)."""
    schema = arrow_schema()
    for name in ("advantage", "kept", "drop_reason"):
        column = pa.array([r[name] for r in rows], type=schema.field(name).type)
        table = table.set_column(table.column_names.index(name), schema.field(name), column)
    return table


def run_filter(
    *,
    ctx: RoundContext,
    staging: str | None,
    config: FilterConfig,
    target_groups: int,
    rollout_stats: Annotated[Stats, NotInput("a measurement; it travels in the manifest")],
    carryover: str | None = None,
) -> TrajectoryVersion:
    """Filter the staged rollout and commit it as this round's trajectory version.

    ``carryover``: the staged unfinished samples (``Staged.carryover``), committed with the version as
    its ``carryover.parquet`` attachment when there are any; the next round resumes them.
    ``rollout_stats`` travel in the manifest, so a resumed round still reports how its rollout went.
    Idempotent: once the round's version is committed it is returned as it is (staging is gone by then)."""
    root = StorageRoot.of(ctx.storage)
    committed = committed_round_version(root, ctx.run_id, ctx.round)
    if committed is not None:
        columns = ["group_id", "kept", "drop_reason", "reward", "completion_token_ids", "token_policy_versions"]
        rows = read_table(root, committed, columns=columns).to_pylist()
        return TrajectoryVersion(
            version=committed.version, uri=committed.directory, stats=filter_stats(rows), resumed=True
        )
    missing = missing_staged(root, staging, carryover)
    if staging is None or missing:
        raise TrajectoryStoreError(
            f"round {ctx.round} of run {ctx.run_id}: the staged rollout {missing[0] if missing else None} is gone "
            f"and no trajectory version is committed; delete {root.stage_record(ctx.run_id, ctx.round, 'rollout')} "
            "and resume to generate the round again"
        )
    table = read_staged(root, staging)
    # decisions need a few light columns; the heavy ones (texts, logprobs) stay in Arrow, untouched
    rows = table.select(DECISION_INPUTS).to_pylist()
    attachments = {}
    if carryover is not None:  # the round's unfinished samples: committed with its version, resumed next round
        carry = read_staged_carryover(root, carryover)
        if carry is not None:
            attachments[CARRYOVER] = carry
    history = history_baselines(root, ctx.run_id, ctx.round, config.history_baseline_rounds)
    rows = apply_decisions(rows, decide(rows, config, ctx.parent_policy_version, history), target_groups)
    table = with_decisions(table, rows)
    meta = {
        "kind": "rollout",
        "run_id": ctx.run_id,
        "round": ctx.round,
        "parent": None,
        "derivation": {
            "filter": config.model_dump(mode="json"),
            "target_groups": target_groups,
            "policy_version": ctx.parent_policy_version,
        },
        "rollout_stats": rollout_stats,
    }
    manifest = write_version(
        root, lambda v: root.trajectory_version(ctx.run_id, ctx.round, v), table, meta, attachments
    )
    clear_staging(root, ctx.run_id, ctx.round)  # committed: the staging copy is redundant
    return TrajectoryVersion(version=manifest.version, uri=manifest.directory, stats=filter_stats(rows))
