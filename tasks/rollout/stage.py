"""The rollout stage: generate and verify a round's samples from its parent checkpoint, stage them as Parquet.

The collection itself (lazy feeding, the ready pool, carry-over) is tasks/rollout/collection.py; this stage finds
the round's inputs (its carry-over, the curriculum's solved prompts, the checkpoint it starts from), takes the live
engine, turns speculation on for the round, and stages what the collection returns: every sample of a ready group,
and the carry-over, as staged Parquet files (uncommitted; filter commits them with the version) and stats.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from models.checkpoint import context_length
from storage import checkpoints
from storage.paths import StorageRoot
from storage.trajectories import committed_round_version, read_carryover, read_manifest, stage_rollout
from tasks.config.base import AddedInput, NotInput
from tasks.config.environment import EpisodeConfig
from tasks.config.filter import FilterConfig
from tasks.config.prompts import PromptsConfig
from tasks.config.rollout import RolloutConfig
from tasks.config.verify import VerifyConfig
from tasks.filter.history import history_baselines
from tasks.rollout.collection import RolloutCollection
from tasks.rollout.curriculum import solved_prompts
from tasks.rollout.episodes import EpisodeCollection
from tasks.rollout.overlap import Overlapped
from tasks.rollout.speculation import RoundSpeculation
from tasks.round.context import RoundContext
from tasks.round.results import Staged
from tasks.serving.engines import Placement
from tasks.serving.live import LiveEngines
from tasks.verifiers.pool import check_infra_failure_rate


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
    environment: Annotated[str | None, AddedInput(since="2026-12-04", keyed_at_default=False)] = None,
    episode: Annotated[EpisodeConfig | None, AddedInput(since="2026-12-04", keyed_at_default=False)] = None,
    engines: Annotated[LiveEngines, NotInput("the live engines of the flow that runs the round")],
    progress: Annotated[Callable[[str], None] | None, NotInput("a progress callback")] = None,
    overlap: Annotated[
        Overlapped | None, NotInput("overlap mode's hand-over: fixed by the round and round.mode, which the key holds")
    ] = None,
    device: Annotated[
        str, NotInput("where it computes: rows committed on one machine are not generated again")
    ] = "auto",
) -> Staged:
    """Generate and verify this round's samples from the parent checkpoint on the live rollout engine (``engines``);
    stage them as Parquet.

    ``carry_from``: the committed trajectory version (URI) whose carry-over this round resumes first,
    the previous round's (``carry_source``); None resumes nothing. The round's own unfinished samples
    are staged beside its rows (``Staged.carryover``) for filter to commit with its version.
    ``overlap``: start from ``overlap.start_checkpoint`` instead, while the parent is still training,
    and switch to the parent mid-way (tasks/rollout/overlap.py). ``device``: where an embedded engine generates.
    ``environment``: the round's samples are multi-turn episodes in this environment (``pkg.mod:Name``), run as
    ``episode`` says (tasks/rollout/episodes.py; None: its defaults); None: one completion per sample, scored by
    ``verify``."""
    root = StorageRoot.of(ctx.storage)
    committed = committed_round_version(root, ctx.run_id, ctx.round)
    if committed is not None:  # resumed after filter committed this round: generating again could only differ
        return Staged(staging=None, stats=committed.body.get("rollout_stats", {}), resumed=True)
    carried = read_carryover(root, read_manifest(root, carry_from)) if carry_from is not None else []
    solved = frozenset()
    if prompts.solved_weight < 1:
        solved = solved_prompts(root, ctx.run_id, ctx.round, prompts.history_rounds)
    baselines = history_baselines(root, ctx.run_id, ctx.round, filtering.history_baseline_rounds)
    start, start_version = ctx.parent_checkpoint, ctx.parent_policy_version
    if overlap is not None:
        start, start_version = overlap.start_checkpoint, overlap.start_version
    local = checkpoints.local_copy(root, start)
    engine, tokenizer, _ = engines.serve(
        rollout.engine,
        local,
        dtype=rollout.dtype,
        policy_version=start_version,
        max_batch=rollout.max_batch,
        placement=Placement(
            rollout.replicas, rollout.ray_address, rollout.gpu_memory_utilization, rollout.tensor_parallel_size
        ),
        update_kv=rollout.update_kv,
        device=device,
    )
    if environment is not None:
        episodes = EpisodeCollection(
            engine,
            tokenizer,
            environment=environment,
            episode=episode or EpisodeConfig(),
            prompts=prompts,
            rollout=rollout,
            filtering=filtering,
            target_groups=target_groups,
            seed=ctx.stage_seed("rollout"),
            run_id=ctx.run_id,
            round_index=ctx.round,
            max_context=context_length(local),
            policy_version=ctx.parent_policy_version,
            solved=solved,
            baselines=baselines,
        )
        result = episodes.collect(progress=progress)
        check_infra_failure_rate(result.stats, verify.max_infra_failure_rate, ctx.round)
        staging, carryover = stage_rollout(root, ctx.run_id, ctx.round, result.rows, result.carry_rows)
        return Staged(staging=staging, carryover=carryover, stats=result.stats)
    collection = RolloutCollection(
        engine,
        tokenizer,
        prompts=prompts,
        rollout=rollout,
        verify=verify,
        filtering=filtering,
        target_groups=target_groups,
        seed=ctx.stage_seed("rollout"),
        run_id=ctx.run_id,
        round_index=ctx.round,
        max_context=context_length(local),
        policy_version=ctx.parent_policy_version,
        solved=solved,
        baselines=baselines,
    )
    with RoundSpeculation(engine, rollout.speculative, root, ctx.run_id, ctx.round) as speculation:
        if speculation.why_not and progress:
            progress(f"rollout: speculative rollout is off: {speculation.why_not}")
        result = collection.collect(
            carried_rows=carried,
            next_policy=overlap.next_policy if overlap is not None else None,
            progress=progress,
        )
    result.stats.update(speculation.figures)
    check_infra_failure_rate(result.stats, verify.max_infra_failure_rate, ctx.round)  # before anything is staged
    staging, carryover = stage_rollout(root, ctx.run_id, ctx.round, result.rows, result.carry_rows)
    return Staged(staging=staging, carryover=carryover, stats=result.stats)
