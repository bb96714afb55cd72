"""How a round's kept rows become the update's minibatches: whole groups per optimizer step, in stored or
seeded-shuffle order (carried-over groups first, or spread among the others); a worker's share of each
(train.workers > 1); and micro-batches of a token budget (train.max_tokens_per_microbatch). Plain Python over
the rows; tasks/train/policy_update.py trains on them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from models.loss import StepTotals
from storage.trajectories import policy_mask, policy_token_count
from tasks.config.train import TrainConfig


@dataclass(kw_only=True)
class TrainBatch:
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    behaviour: list[list[float]]
    advantages: list[float]
    policy_versions: list[list[int]]
    top_p: list[float]  # per sample: the nucleus its behaviour logprobs were renormalised over
    max_tokens: int | None = None  # the sampling limit on completion tokens (dr_grpo's denominator)
    step: StepTotals | None = None  # the whole minibatch's totals, when this is one worker's share of it
    idle: bool = False  # a stand-in for a worker with no rows in this minibatch: it trains on nothing
    policy_mask: list[list[bool]] | None = None
    """Per completion token, whether the policy sampled it: False at an episode's observation tokens, which stay in
    the sequence the trainer scores and out of the loss. None: every token is the policy's (single-turn rows)."""
    token_advantages: list[list[float]] | None = None
    """Per completion token, its advantage under ``train.credit: prefix`` (``prefix_credit``). None: every token
    takes its sample's."""

    def policy_tokens(self) -> int:
        """Completion tokens in the loss (observation tokens not counted)."""
        if self.policy_mask is None:
            return sum(len(c) for c in self.completion_ids)
        return sum(sum(m) for m in self.policy_mask)


def minibatches(
    rows: list[dict],
    groups_per_step: int,
    steps: int,
    shuffle_seed: int | None = None,
    carried_before: int | None = None,
    credit: str = "sample",
) -> list[TrainBatch]:
    """Kept rows (in stored order) -> up to ``steps`` minibatches of whole groups: in stored order, or
    with ``shuffle_seed`` in the order of a hash of (seed, group id), which depends on nothing but the
    rows and the seed (``TrainConfig.minibatch_order``). With ``carried_before`` (the round's parent version) as
    well, groups holding a token another version sampled (``carried_over``) come first, in the same hashed order
    among themselves: they fill as few minibatches as they can. ``credit``: ``train.credit``."""
    return [
        batch_of(sum(groups, []), credit=credit)
        for groups in step_groups(rows, groups_per_step, steps, shuffle_seed, carried_before)
    ]


def sharded_minibatches(
    rows: list[dict],
    groups_per_step: int,
    steps: int,
    shuffle_seed: int | None,
    workers: int,
    carried_before: int | None = None,
    credit: str = "sample",
) -> list[list[TrainBatch]]:
    """``minibatches`` split between ``workers``: per worker, its share of every minibatch, whole groups in
    contiguous runs (so a group's samples share their prompt's pass), each share carrying its minibatch's
    totals. A worker the minibatch has no group for gets an idle stand-in (its first group, counting for
    nothing): every worker takes part in every step's collectives."""
    shares: list[list[TrainBatch]] = [[] for _ in range(workers)]
    for groups in step_groups(rows, groups_per_step, steps, shuffle_seed, carried_before):
        chosen = sum(groups, [])
        sampled = max((sampling_limit(r) for r in chosen), default=0) or None
        totals = StepTotals(sum(policy_token_count(r) for r in chosen), len(chosen), sampled)
        bounds = [len(groups) * w // workers for w in range(workers + 1)]
        for worker, (a, b) in enumerate(zip(bounds, bounds[1:])):
            mine = sum(groups[a:b], [])
            shares[worker].append(batch_of(mine or groups[0], totals, idle=not mine, credit=credit))
    return shares


def step_groups(
    rows: list[dict], groups_per_step: int, steps: int, shuffle_seed: int | None, carried_before: int | None = None
) -> list[list[list[dict]]]:
    """Per optimizer step, its groups' rows (see ``minibatches``)."""
    order: list[str] = []
    by_group: dict[str, list[dict]] = {}
    for row in rows:
        if row["group_id"] not in by_group:
            order.append(row["group_id"])
            by_group[row["group_id"]] = []
        by_group[row["group_id"]].append(row)
    if shuffle_seed is not None:
        order.sort(key=lambda group_id: _group_key(shuffle_seed, group_id))
    if carried_before is not None:  # a stable sort: the hashed order holds within each part
        order.sort(
            key=lambda group_id: (
                not carried_over((r["token_policy_versions"] for r in by_group[group_id]), carried_before)
            )
        )
    out = []
    for step in range(steps):
        groups = [by_group[g] for g in order[step * groups_per_step : (step + 1) * groups_per_step]]
        if not groups:
            break
        out.append(groups)
    return out


def carried_over(token_versions: Iterable[Sequence[int]], current: int) -> bool:
    """Whether any token (per sample, its tokens' policy versions) was sampled by another policy than ``current``,
    the round's parent: a sample carried over from an earlier round."""
    return any(v != current for versions in token_versions for v in versions)


def sampling_limit(row: dict) -> int:
    return (row.get("sampling") or {}).get("max_tokens") or 0


def batch_of(
    chosen: list[dict], step: StepTotals | None = None, idle: bool = False, credit: str = "sample"
) -> TrainBatch:
    masks = [policy_mask(r) for r in chosen]
    return TrainBatch(
        prompt_ids=[r["prompt_token_ids"] for r in chosen],
        completion_ids=[r["completion_token_ids"] for r in chosen],
        behaviour=[r["rollout_logprobs"] for r in chosen],
        advantages=[r["advantage"] for r in chosen],
        policy_versions=[r["token_policy_versions"] for r in chosen],
        top_p=[float((r.get("sampling") or {}).get("top_p") or 1.0) for r in chosen],
        max_tokens=step.max_tokens if step else max((sampling_limit(r) for r in chosen), default=0) or None,
        step=step,
        idle=idle,
        policy_mask=None
        if all(m is None for m in masks)
        else [[True] * len(r["completion_token_ids"]) if m is None else m for r, m in zip(chosen, masks)],
        token_advantages=None if credit == "sample" else token_credit(chosen),
    )


def token_credit(rows: list[dict]) -> list[list[float]]:
    """Per row (in order), its tokens' advantages under prefix credit, by group (``prefix_credit``)."""
    groups: dict[str, list[int]] = {}
    for index, row in enumerate(rows):
        groups.setdefault(row["group_id"], []).append(index)
    out: list[list[float]] = [[] for _ in rows]
    for members in groups.values():
        credits = prefix_credit(
            [rows[i]["completion_token_ids"] for i in members], [rows[i]["advantage"] for i in members]
        )
        for index, credit in zip(members, credits):
            out[index] = credit
    return out


def prefix_credit(completions: list[list[int]], advantages: list[float]) -> list[list[float]]:
    """One group's samples -> per completion token, the change its choice makes to the mean advantage of the group's
    samples that share the completion up to it: Q(prefix + token) - Q(prefix), Q(empty) = 0 (an advantage is already
    centred on its baseline). Tokens the group agrees on carry none of a sample's credit, the token where samples part
    ways carries it, and a sample's tokens after it has parted from every other carry none. A sample's credits add up
    to the mean advantage of the samples identical to it (its own advantage, unless a longer sample extends it); summed
    over the group, each token position's gradient is GRPO's with a baseline per prefix instead of per group."""
    out = []
    for own, tokens in enumerate(completions):
        alive, before, credit = list(range(len(completions))), 0.0, []
        for t, token in enumerate(tokens):
            if len(alive) > 1:
                alive = [j for j in alive if len(completions[j]) > t and completions[j][t] == token]
            value = sum(advantages[j] for j in alive) / len(alive) if len(alive) > 1 else advantages[own]
            credit.append(value - before)
            before = value
        out.append(credit)
    return out


def _group_key(seed: int, group_id: str) -> bytes:
    return hashlib.blake2b(f"{seed}/{group_id}".encode(), digest_size=8).digest()


def microbatches(batch: TrainBatch, config: TrainConfig) -> list[TrainBatch]:
    """A minibatch as micro-batches of at most ``config.max_tokens_per_microbatch`` padded tokens (rows x
    (longest prompt + longest completion)), rows in order so a group's samples stay together where they fit;
    at least one row each. Every micro-batch carries the whole minibatch's totals, so their losses add up to
    the minibatch's. Without the setting: the minibatch itself, as it is."""
    budget = config.max_tokens_per_microbatch
    if budget is None:
        return [batch]
    totals = batch.step or StepTotals(batch.policy_tokens(), len(batch.completion_ids), batch.max_tokens)
    bounds, first, widest = [0], 0, 0
    for row, (prompt, completion) in enumerate(zip(batch.prompt_ids, batch.completion_ids)):
        widest = max(widest, len(prompt) + len(completion))
        if row > first and (row - first + 1) * widest > budget:
            bounds.append(row)
            first, widest = row, len(prompt) + len(completion)
    bounds.append(len(batch.completion_ids))
    return [
        TrainBatch(
            prompt_ids=batch.prompt_ids[a:b],
            completion_ids=batch.completion_ids[a:b],
            behaviour=batch.behaviour[a:b],
            advantages=batch.advantages[a:b],
            policy_versions=batch.policy_versions[a:b],
            top_p=batch.top_p[a:b],
            max_tokens=batch.max_tokens,
            step=totals,
            idle=batch.idle,
            policy_mask=None if batch.policy_mask is None else batch.policy_mask[a:b],
            token_advantages=None if batch.token_advantages is None else batch.token_advantages[a:b],
        )
        for a, b in zip(bounds, bounds[1:])
    ]
