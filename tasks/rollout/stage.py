"""Rollout: generate groups, verify samples as they finish, stop once the trainable batch is full.

The headline figure is *time to a trainable batch*: the round needs ``target_groups`` complete groups
that will survive filtering (not every group generated), so prompts are fed to the engine lazily and
feeding stops the moment enough trainable groups are verified (tasks/rollout/ready_pool.py). With partial
rollouts the samples still generating are then stopped, not waited for: they and the samples still
waiting on the environment are the round's *carry-over*, committed with its trajectory version and
resumed first by the next round under its newer policy. Complete groups that arrive after the batch
is full are stored too (filter marks them ``batch_full``): nothing generated is thrown away unrecorded.

Output: every sample of a ready group, and the carry-over, as staged Parquet files (uncommitted;
filter commits them with the version) and stats.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Annotated

from transformers import PreTrainedTokenizerBase

from models.checkpoint import context_length
from models.engines.types import GroupRequest, RolloutEngine, SamplingParams
from models.prompt import encode_prompt
from storage import checkpoints
from storage.paths import StorageRoot
from storage.trajectories import (
    TrajectoryRow,
    committed_round_version,
    read_carryover,
    read_manifest,
    stage_rollout,
)
from tasks.config.filter import FilterConfig
from tasks.config.prompts import PromptsConfig
from tasks.config.rollout import RolloutConfig
from tasks.config.verify import VerifyConfig
from tasks.filter.stage import group_is_trainable
from tasks.prompts.sources import PromptError, prompt_stream
from tasks.rollout.curriculum import admitted, solved_prompts
from tasks.rollout.overlap import NextPolicy, Overlapped, RolloutCancelled
from tasks.rollout.ready_pool import PARTIAL, Group, Harvest, PoolLimits, ReadyPool
from tasks.rollout.rows import Drawn, groups_from_carry, sample_row
from tasks.rollout.speculation import RoundSpeculation
from tasks.round.context import RoundContext
from tasks.round.results import NotInput, Staged
from tasks.serving.engines import Placement, connect_ray, serving_engine
from tasks.verifiers.outcome import Outcome
from tasks.verifiers.pool import VerifierPool, check_infra_failure_rate
from tasks.verifiers.registry import rollout_verifier, rollout_verifier_version, scores_inline


@dataclass
class RolloutResult:
    """The samples of ready groups in the order their groups finished, the carry-over, and the figures."""

    rows: list[TrajectoryRow]
    carry_rows: list[TrajectoryRow]
    stats: dict[str, float]


def generate_and_verify(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    prompts: PromptsConfig,
    rollout: RolloutConfig,
    verify: VerifyConfig,
    filtering: FilterConfig,
    target_groups: int,
    seed: int,
    run_id: str,
    round_index: int,
    progress=None,
    max_context: int | None = None,
    carried_rows: list[TrajectoryRow] | None = None,
    policy_version: int | None = None,
    solved: frozenset[str] = frozenset(),
    next_policy: NextPolicy | None = None,
) -> RolloutResult:
    """One round's collection. ``carried_rows``: the previous round's carry-over, resumed first.
    ``policy_version``: the policy being trained on these rows (filter.max_staleness is judged against
    it; None: not). ``solved``: prompt ids the curriculum draws with probability ``prompts.solved_weight``.
    ``next_policy``: overlap mode, the weights the engine switches to mid-way (tasks/rollout/overlap.py).

    ``max_context``: the model's positions; a prompt that cannot fit with rollout.max_tokens is an
    input error, raised before it is generated (the engine would fail deep inside, or silently wrap)."""
    verifier_name = verify.verifier or prompts.task
    sampling = SamplingParams(rollout.temperature, rollout.top_p, rollout.max_tokens, seed, stop=tuple(rollout.stop))
    stream = prompt_stream(prompts, seed)
    carried = groups_from_carry(carried_rows or [], tuple(rollout.stop))
    start = time.time()

    skipped = 0
    # Prompts recur within a round and completions far more (a few distinct answers per prompt), so
    # each distinct text is tokenized once and each distinct completion decoded once.
    encoded: dict[tuple, tuple[str, tuple[int, ...]]] = {}
    decoded: dict[tuple[int, ...], str] = {}

    def fresh():
        nonlocal skipped
        position = 0
        for index in range(int(target_groups * rollout.max_prompts_factor)):
            while True:  # the curriculum: a recently solved prompt is drawn with probability solved_weight
                prompt, position = next(stream), position + 1
                weight = prompts.solved_weight if prompt.prompt_id in solved else 1.0
                if admitted(seed, position, weight):
                    break
                skipped += 1
            key = (prompt.text, prompt.messages)
            if key not in encoded:
                encoded[key] = encode_prompt(tokenizer, prompt)
            text, ids = encoded[key]
            if text != prompt.text:  # rendered through the chat template: rows store what the engine saw
                prompt = replace(prompt, text=text)
            if max_context is not None and len(ids) + rollout.max_tokens > max_context:
                raise PromptError(
                    context_overflow(prompts.source, prompt.prompt_id, len(ids), rollout.max_tokens, max_context)
                )
            request = GroupRequest(f"r{round_index}-g{index:06d}", ids, rollout.samples_per_prompt, sampling)
            yield Group(request, prompt.reference, Drawn(prompt, weight), time.time())

    def trainable(group: Group) -> bool:
        rows = [
            {
                "group_id": group.request.group_id,
                "sample_index": slot.index,
                "reward": slot.verdict.reward,
                "outcome": slot.verdict.outcome.value,
                "token_policy_versions": slot.sample.token_policy_versions,
                "finish_reason": slot.sample.finish_reason,
                "completion_token_ids": slot.sample.token_ids,
                "sampling": group.request.sampling.as_dict(),
            }
            for slot in group.slots
        ]
        return group_is_trainable(rows, filtering, policy_version)

    def decode(token_ids: list[int]) -> str:
        key = tuple(token_ids)
        text = decoded.get(key)
        if text is None:
            text = decoded[key] = tokenizer.decode(token_ids, skip_special_tokens=True)
        return text

    if verify.on_ray:
        connect_ray(Placement(rollout.replicas, rollout.ray_address))
    verifiers = VerifierPool(
        rollout_verifier(verifier_name, verify, seed),
        verify.workers,
        verify.infra_retries,
        verify.infra_retry_budget,
        verify.timeout_s,
        inline=scores_inline(verifier_name, verify),
    )
    limits = PoolLimits(
        # Verdicts must keep pace with the engine, which finishes up to max_batch samples a step: a
        # cap of 2 x workers let them lag, so the pool kept feeding groups it did not need, paying for
        # samples and CPU time the round never trained on (docs/performance.md).
        max_outstanding=max(2 * verify.workers, rollout.max_batch),
        verdict_wait_s=rollout.verdict_wait_s,
        stop_in_flight=rollout.partial_rollouts and rollout.collection == "ready_pool",
        stop_at_cap_below=rollout.max_batch * rollout.replicas // 2,  # where the engines would refill
    )
    pool = ReadyPool(verifiers.submit, decode, trainable, target_groups, limits)
    harvest: Harvest | None = None
    try:
        pool.carry_in(carried)
        if rollout.collection == "sync_barrier":
            _collect_in_barriers(engine, pool, fresh(), target_groups, progress)
        else:
            seen = 0
            requests = pool.feed(fresh(), int(target_groups * rollout.max_prompts_factor))
            if next_policy is None:
                generating = engine.generate(requests, pool.should_stop)
            else:  # overlap: new weights mid-way; a cancelled hand-over stops the engine at once
                generating = engine.generate(requests, lambda: next_policy.cancelled or pool.should_stop(), next_policy)
            for sample in generating:
                pool.on_sample(sample)
                seen += 1
                if progress and seen % 256 == 0:  # the callback throttles what it shows
                    progress(f"rollout: {seen} samples, {pool.trainable}/{target_groups} trainable groups")
        if next_policy is not None and next_policy.cancelled:
            raise RolloutCancelled(f"round {round_index}'s rollout was cancelled: {next_policy.cancel_reason}")
        harvest = pool.finish()
    finally:
        if harvest is not None and harvest.abandoned:
            # Verifications left running belong to carried samples, verified again next round; the
            # pool's close waits for them, which is exactly the straggler wait partial rollouts avoid.
            threading.Thread(target=verifiers.close, name="verifier-pool-drain", daemon=True).start()
        else:
            verifiers.close()
    end = time.time()
    info = engine.info
    context = {
        "run_id": run_id,
        "round": round_index,
        "engine": {"name": info.name, "version": info.version, "dtype": info.dtype},
        "verifier": {"name": verifier_name, "version": rollout_verifier_version(verifier_name, verify)},
    }
    rows = [sample_row(g, slot, context) for g in harvest.ready for slot in g.slots]
    carry_rows = [sample_row(g, slot, context, carried=True) for g in harvest.carry for slot in g.slots]
    stats = {**rollout_stats(rows, carry_rows, harvest, carried, target_groups, start, end), **verifiers.stats()}
    if next_policy is not None:
        stats.update(next_policy.stats())
    stats["rollout/curriculum_solved_prompts"] = len(solved)
    stats["rollout/curriculum_skipped_prompts"] = skipped
    return RolloutResult(rows=rows, carry_rows=carry_rows, stats=stats)


def _collect_in_barriers(engine: RolloutEngine, pool: ReadyPool, fresh, target_groups: int, progress) -> None:
    """The synchronous barrier: batches of ``target_groups`` prompts, each generated to its last sample
    and verified to its last verdict before the pool is asked whether it holds enough trainable groups.
    ``fresh`` ends at the over-provisioning cap."""
    batch_index = 0
    while not pool.batch_full():
        batch = list(itertools.islice(fresh, target_groups))
        if not batch:
            return
        for sample in engine.generate(pool.feed_batch(batch)):
            pool.on_sample(sample)
        pool.drain()
        batch_index += 1
        if progress:
            progress(f"rollout: barrier {batch_index}, {pool.trainable}/{target_groups} trainable groups")


def context_overflow(source: str, prompt_id: str, prompt_tokens: int, max_tokens: int, max_context: int) -> str:
    return (
        f"prompt {prompt_id} of {source} is {prompt_tokens} tokens; with rollout.max_tokens={max_tokens} it needs "
        f"{prompt_tokens + max_tokens} positions but the model has {max_context}; shorten or drop the prompt, "
        f"lower rollout.max_tokens, or use a model with a longer context"
    )


def quantiles(values: list[float], prefix: str) -> dict[str, float]:
    """p50/p90/p99/max of ``values`` (nearest rank) under ``prefix``; zeros when there are none."""
    ordered = sorted(values) or [0.0]

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        f"{prefix}_p50_s": rank(0.5),
        f"{prefix}_p90_s": rank(0.9),
        f"{prefix}_p99_s": rank(0.99),
        f"{prefix}_max_s": ordered[-1],
    }


def verifier_waits(rows: list[TrajectoryRow], start: float) -> list[float]:
    """Seconds each sample finished in this round waited for a free verifier: from the end of its
    generation to its verdict, less the verifier call itself. Near zero while verify.workers keeps up with
    the engine; when the environment's concurrency is the round's bottleneck, this is where it shows."""
    waits = []
    for r in rows:
        finished, verified, latency = r.finished_at, r.verified_at, r.verify_latency_s
        if verified is None or latency is None or finished.timestamp() < start:
            continue
        waits.append(max(0.0, verified.timestamp() - finished.timestamp() - latency))
    return waits


def rollout_stats(
    rows: list[TrajectoryRow],
    carry_rows: list[TrajectoryRow],
    harvest: Harvest,
    carried: list[Group],
    target_groups: int,
    start: float,
    end: float,
) -> dict[str, float]:
    outcomes = Counter(r.outcome for r in rows)
    tokens = sum(len(r.completion_token_ids) for r in rows)
    rewards = [r.reward for r in rows if r.reward is not None]
    wall = max(end - start, 1e-9)
    versions = [v for r in rows for v in r.token_policy_versions]
    partial_out = [r for r in carry_rows if r.carry_state == PARTIAL]
    carried_in = {g.request.group_id for g in carried}
    return {
        "rollout/groups": len(harvest.ready),
        "rollout/groups_trainable": harvest.trainable,
        "rollout/target_groups": target_groups,
        "rollout/batch_full": float(harvest.trainable >= target_groups),
        "rollout/samples": len(rows),
        "rollout/tokens": tokens,
        "rollout/tokens_per_s": tokens / wall,
        "rollout/wall_s": wall,
        "rollout/time_to_trainable_batch_s": (harvest.batch_ready_at or end) - start,
        "rollout/batch_ready_at": harvest.batch_ready_at or end,
        "rollout/stop_to_end_s": end - harvest.stopped_at if harvest.stopped_at else 0.0,
        **quantiles([r.gen_latency_s for r in rows], "rollout/gen_latency"),
        **quantiles([r.verify_latency_s for r in rows if r.verify_latency_s is not None], "verify/env_latency"),
        **quantiles(verifier_waits(rows, start), "verify/queue_wait"),
        "rollout/mean_completion_tokens": tokens / max(len(rows), 1),
        "rollout/truncated_fraction": sum(r.finish_reason == "length" for r in rows) / max(len(rows), 1),
        "rollout/policy_version_min": min(versions, default=0),
        "rollout/policy_version_max": max(versions, default=0),
        "rollout/samples_spanning_versions": sum(len(set(r.token_policy_versions)) > 1 for r in rows),
        "rollout/carried_in_groups": len(carried_in),
        "rollout/carried_in_finished_groups": sum(g.request.group_id in carried_in for g in harvest.ready),
        "rollout/carried_out_groups": len(harvest.carry),
        "rollout/carried_out_partial_samples": len(partial_out),
        "rollout/carried_out_tokens": sum(len(r.completion_token_ids) for r in partial_out),
        "rollout/carried_out_unverified_samples": sum(r.carry_state == "unverified" for r in carry_rows),
        "rollout/verifications_abandoned": harvest.abandoned,
        "rollout/slow_environment": float(harvest.waited_for_slow_environment),
        "verify/mean_reward": statistics.fmean(rewards) if rewards else 0.0,
        "verify/success": outcomes.get(Outcome.SUCCESS.value, 0),
        "verify/model_failure": outcomes.get(Outcome.MODEL_FAILURE.value, 0),
        "verify/infra_failure": outcomes.get(Outcome.INFRA_FAILURE.value, 0),
        "verify/unknown": outcomes.get(Outcome.UNKNOWN.value, 0),
        "verify/infra_failure_rate": outcomes.get(Outcome.INFRA_FAILURE.value, 0) / max(len(rows), 1),
        "verify/mean_latency_s": statistics.fmean(r.verify_latency_s for r in rows) if rows else 0.0,
    }


# -- the stage ------------------------------------------------------------------------------------


def carry_source(storage: str, run_id: str, round_index: int) -> str | None:
    """The trajectory version whose carry-over round ``round_index`` resumes: the previous round's
    committed version (its URI), or None for the first round."""
    if round_index <= 1:
        return None
    previous = committed_round_version(StorageRoot.of(storage), run_id, round_index - 1)
    return None if previous is None else previous.directory


def run_rollout(
    *,
    ctx: RoundContext,
    prompts: PromptsConfig,
    rollout: RolloutConfig,
    verify: VerifyConfig,
    filtering: FilterConfig,
    target_groups: int,
    carry_from: str | None = None,
    progress: Annotated[Callable[[str], None] | None, NotInput("a progress callback")] = None,
    overlap: Annotated[
        Overlapped | None, NotInput("overlap mode's hand-over: fixed by the round and round.mode, which the key holds")
    ] = None,
    device: Annotated[
        str, NotInput("where it computes: rows committed on one machine are not generated again")
    ] = "auto",
) -> Staged:
    """Generate and verify this round's samples from the parent checkpoint; stage them as Parquet.

    ``carry_from``: the committed trajectory version (URI) whose carry-over this round resumes first,
    the previous round's (``carry_source``); None resumes nothing. The round's own unfinished samples
    are staged beside its rows (``Staged.carryover``) for filter to commit with its version.
    ``overlap``: start from ``overlap.start_checkpoint`` instead, while the parent is still training,
    and switch to the parent mid-way (tasks/rollout/overlap.py). ``device``: where an embedded engine generates."""
    root = StorageRoot.of(ctx.storage)
    committed = committed_round_version(root, ctx.run_id, ctx.round)
    if committed is not None:  # resumed after filter committed this round: generating again could only differ
        return Staged(staging=None, stats=committed.body.get("rollout_stats", {}), resumed=True)
    carried = read_carryover(root, read_manifest(root, carry_from)) if carry_from is not None else []
    solved = frozenset()
    if prompts.solved_weight < 1:
        solved = solved_prompts(root, ctx.run_id, ctx.round, prompts.history_rounds)
    start, start_version = ctx.parent_checkpoint, ctx.parent_policy_version
    if overlap is not None:
        start, start_version = overlap.start_checkpoint, overlap.start_version
    local = checkpoints.local_copy(root, start)
    engine, tokenizer, _ = serving_engine(
        rollout.engine,
        local,
        rollout.dtype,
        start_version,
        rollout.max_batch,
        Placement(rollout.replicas, rollout.ray_address, rollout.gpu_memory_utilization, rollout.tensor_parallel_size),
        update_kv=rollout.update_kv,
        device=device,
    )
    speculation = RoundSpeculation(engine, rollout.speculative, root, ctx.run_id, ctx.round)
    if speculation.why_not and progress:
        progress(f"rollout: speculative rollout is off: {speculation.why_not}")
    try:
        result = generate_and_verify(
            engine,
            tokenizer,
            prompts,
            rollout,
            verify,
            filtering,
            target_groups,
            ctx.stage_seed("rollout"),
            ctx.run_id,
            ctx.round,
            progress,
            context_length(local),
            carried,
            ctx.parent_policy_version,
            solved,
            overlap.next_policy if overlap is not None else None,
        )
    finally:
        figures = speculation.finish()
    result.stats.update(figures)
    check_infra_failure_rate(result.stats, verify.max_infra_failure_rate, ctx.round)  # before anything is staged
    staging, carryover = stage_rollout(root, ctx.run_id, ctx.round, result.rows, result.carry_rows)
    return Staged(staging=staging, carryover=carryover, stats=result.stats)
