"""One round's collection: groups generated, samples verified as they finish, stopped once the batch is full.

The headline figure is *time to a trainable batch*: the round needs ``target_groups`` complete groups that will
survive filtering (not every group generated), so prompts are fed to the engine lazily and feeding stops the moment
enough trainable groups are verified (tasks/rollout/ready_pool.py). With partial rollouts the samples still
generating are then stopped, not waited for: they and the samples still waiting on the environment are the
round's *carry-over*, committed with its trajectory version and resumed first by the next round under its newer
policy. Complete groups that arrive after the batch is full are stored too (filter marks them ``batch_full``):
nothing generated is thrown away unrecorded.

    collection = RolloutCollection(engine, tokenizer, prompts=..., rollout=..., verify=..., filtering=...,
                                   target_groups=64, seed=seed, run_id=run_id, round_index=k)
    result = collection.collect(carried_rows=previous_carry_over)   # rows of ready groups, carry-over, figures
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace

from transformers import PreTrainedTokenizerBase

from models.engines.types import GroupRequest, RolloutEngine, SamplingParams
from models.prompt import prompt_encodings
from storage.trajectories import TrajectoryRow
from tasks.config.filter import FilterConfig
from tasks.config.prompts import PromptsConfig
from tasks.config.rollout import RolloutConfig
from tasks.config.verify import VerifyConfig
from tasks.filter.stage import group_is_trainable
from tasks.prompts.sources import PromptError, prompt_stream
from tasks.rollout.curriculum import admitted
from tasks.rollout.overlap import NextPolicy, RolloutCancelled
from tasks.rollout.ready_pool import PARTIAL, Group, Harvest, PoolLimits, ReadyPool
from tasks.rollout.rows import Drawn, groups_from_carry, sample_row
from tasks.serving.engines import Placement, connect_ray
from tasks.verifiers.outcome import Outcome
from tasks.verifiers.pool import VerifierPool
from tasks.verifiers.registry import rollout_verifier, rollout_verifier_version, scores_inline


@dataclass
class RolloutResult:
    """The samples of ready groups in the order their groups finished, the carry-over, and the figures."""

    rows: list[TrajectoryRow]
    carry_rows: list[TrajectoryRow]
    stats: dict[str, float]


class RolloutCollection:
    """One round's collection on ``engine``: what it samples is fixed at construction, ``collect`` runs it.

    ``target_groups``: trainable groups the round needs. ``policy_version``: the policy being trained on these rows
    (filter.max_staleness is judged against it; None: not). ``solved``: prompt ids the curriculum draws with
    probability ``prompts.solved_weight``. ``baselines``: prompts' success rates in the history, for
    filter.history_baseline_rounds (tasks/filter/history.py). ``max_context``: the model's positions; a prompt that
    cannot fit with rollout.max_tokens is an input error, raised before it is generated (the engine would fail deep
    inside, or silently wrap)."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: PreTrainedTokenizerBase,
        *,
        prompts: PromptsConfig,
        rollout: RolloutConfig,
        verify: VerifyConfig,
        filtering: FilterConfig,
        target_groups: int,
        seed: int,
        run_id: str,
        round_index: int,
        max_context: int | None = None,
        policy_version: int | None = None,
        solved: frozenset[str] = frozenset(),
        baselines: Mapping[str, float] | None = None,
    ) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.prompts, self.rollout, self.verify, self.filtering = prompts, rollout, verify, filtering
        self.target_groups, self.seed, self.run_id, self.round_index = target_groups, seed, run_id, round_index
        self.max_context, self.policy_version, self.solved = max_context, policy_version, solved
        self.baselines = baselines
        self.verifier_name = verify.verifier or prompts.task
        self.sampling = SamplingParams(
            rollout.temperature, rollout.top_p, rollout.max_tokens, seed, stop=tuple(rollout.stop)
        )
        self.skipped = 0  # prompts the curriculum passed over
        # Prompts recur within a round and across rounds, completions far more (a few distinct answers per
        # prompt): each distinct prompt is tokenized once while the tokenizer lives, each distinct completion
        # decoded once a round.
        self._encode = prompt_encodings(tokenizer)
        self._decoded: dict[tuple[int, ...], str] = {}

    @property
    def max_groups(self) -> int:
        """The over-provisioning cap: groups fed at most."""
        return int(self.target_groups * self.rollout.max_prompts_factor)

    def fresh_groups(self) -> Iterator[Group]:
        """New groups in prompt order, up to the cap; the curriculum draws a recently solved prompt with probability
        ``prompts.solved_weight``."""
        stream = prompt_stream(self.prompts, self.seed)
        position = 0
        for index in range(self.max_groups):
            while True:
                prompt, position = next(stream), position + 1
                weight = self.prompts.solved_weight if prompt.prompt_id in self.solved else 1.0
                if admitted(self.seed, position, weight):
                    break
                self.skipped += 1
            text, ids = self._encode(prompt)
            if text != prompt.text:  # rendered through the chat template: rows store what the engine saw
                prompt = replace(prompt, text=text)
            if self.max_context is not None and len(ids) + self.rollout.max_tokens > self.max_context:
                raise PromptError(
                    context_overflow(
                        self.prompts.source, prompt.prompt_id, len(ids), self.rollout.max_tokens, self.max_context
                    )
                )
            group_id = f"r{self.round_index}-g{index:06d}"
            request = GroupRequest(group_id, ids, self.rollout.samples_per_prompt, self.sampling)
            yield Group(request, prompt.reference, Drawn(prompt, weight), time.time())

    def trainable(self, group: Group) -> bool:
        """Whether a verified group survives filtering (the ready pool's test of a full batch)."""
        rows = [
            {
                "group_id": group.request.group_id,
                "prompt_id": group.meta.prompt.prompt_id,
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
        return group_is_trainable(rows, self.filtering, self.policy_version, self.baselines)

    def decode(self, token_ids: list[int]) -> str:
        key = tuple(token_ids)
        text = self._decoded.get(key)
        if text is None:
            text = self._decoded[key] = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return text

    def collect(
        self,
        *,
        carried_rows: list[TrajectoryRow] | None = None,
        next_policy: NextPolicy | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> RolloutResult:
        """Run the collection. ``carried_rows``: the previous round's carry-over, resumed first. ``next_policy``:
        overlap mode, the weights the engine switches to mid-way (tasks/rollout/overlap.py)."""
        rollout, verify = self.rollout, self.verify
        carried = groups_from_carry(carried_rows or [], tuple(rollout.stop))
        start = time.time()
        if verify.on_ray:
            connect_ray(Placement(rollout.replicas, rollout.ray_address))
        verifiers = VerifierPool(
            rollout_verifier(self.verifier_name, verify, self.seed),
            verify.workers,
            verify.infra_retries,
            verify.infra_retry_budget,
            verify.timeout_s,
            inline=scores_inline(self.verifier_name, verify),
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
        pool = ReadyPool(verifiers.submit, self.decode, self.trainable, self.target_groups, limits)
        harvest: Harvest | None = None
        try:
            pool.carry_in(carried)
            if rollout.collection == "sync_barrier":
                self._collect_in_barriers(pool, progress)
            else:
                self._collect_as_ready(pool, next_policy, progress)
            if next_policy is not None and next_policy.cancelled:
                raise RolloutCancelled(f"round {self.round_index}'s rollout was cancelled: {next_policy.cancel_reason}")
            harvest = pool.finish()
        finally:
            if harvest is not None and harvest.abandoned:
                # Verifications left running belong to carried samples, verified again next round; the
                # pool's close waits for them, which is exactly the straggler wait partial rollouts avoid.
                threading.Thread(target=verifiers.close, name="verifier-pool-drain", daemon=True).start()
            else:
                verifiers.close()
        end = time.time()
        info = self.engine.info
        context = {
            "run_id": self.run_id,
            "round": self.round_index,
            "engine": {"name": info.name, "version": info.version, "dtype": info.dtype},
            "verifier": {
                "name": self.verifier_name,
                "version": rollout_verifier_version(self.verifier_name, verify),
            },
        }
        rows = [sample_row(g, slot, context) for g in harvest.ready for slot in g.slots]
        carry_rows = [sample_row(g, slot, context, carried=True) for g in harvest.carry for slot in g.slots]
        stats = {
            **rollout_stats(
                rows, carry_rows, harvest, carried=carried, target_groups=self.target_groups, start=start, end=end
            ),
            **verifiers.stats(),
        }
        if next_policy is not None:
            stats.update(next_policy.stats())
        stats["rollout/curriculum_solved_prompts"] = len(self.solved)
        stats["rollout/curriculum_skipped_prompts"] = self.skipped
        return RolloutResult(rows=rows, carry_rows=carry_rows, stats=stats)

    def _collect_as_ready(
        self, pool: ReadyPool, next_policy: NextPolicy | None, progress: Callable[[str], None] | None
    ) -> None:
        """The ready pool: prompts fed as the engine has room, samples verified as they finish, until the pool holds
        enough trainable groups (or the cap is fed)."""
        seen = 0
        requests = pool.feed(self.fresh_groups(), self.max_groups)
        if next_policy is None:
            generating = self.engine.generate(requests, pool.should_stop)
        else:  # overlap: new weights mid-way; a cancelled hand-over stops the engine at once
            generating = self.engine.generate(
                requests, lambda: next_policy.cancelled or pool.should_stop(), next_policy
            )
        for sample in generating:
            pool.on_sample(sample)
            seen += 1
            if progress and seen % 256 == 0:  # the callback throttles what it shows
                progress(f"rollout: {seen} samples, {pool.trainable}/{self.target_groups} trainable groups")

    def _collect_in_barriers(self, pool: ReadyPool, progress: Callable[[str], None] | None) -> None:
        """The synchronous barrier: batches of ``target_groups`` prompts, each generated to its last sample
        and verified to its last verdict before the pool is asked whether it holds enough trainable groups."""
        fresh = self.fresh_groups()
        batch_index = 0
        while not pool.batch_full():
            batch = list(itertools.islice(fresh, self.target_groups))
            if not batch:
                return
            for sample in self.engine.generate(pool.feed_batch(batch)):
                pool.on_sample(sample)
            pool.drain()
            batch_index += 1
            if progress:
                progress(f"rollout: barrier {batch_index}, {pool.trainable}/{self.target_groups} trainable groups")


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
    *,
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
