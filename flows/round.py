"""One RL round as a Prefect flow: rollout -> verify -> filter -> store -> train -> publish -> evaluate.

Sequencing only: every stage is a task that takes URIs and configs by keyword and returns a typed
result (tasks/round/results.py) of URIs and small stats. Rollout verifies each sample as it finishes
(verification overlaps generation); filter commits the trajectory version to the store.

``round.mode: overlap`` (tasks/rollout/overlap.py): once this round's trajectories are committed, the next
round's rollout is submitted as its own task run and generates while this round trains, publishes and
evaluates; train hands it the new checkpoint. The round ends when that rollout is recorded (under the
next round, which then finds its rollout committed and goes straight to filter).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prefect import flow
from prefect.runtime import flow_run
from prefect.settings import temporary_settings

from flows.approval import approve_and_promote
from flows.config import RoundConfig
from flows.progress import StageProgress, artifact_key
from flows.stages import PendingStage, Stages
from flows.tasks import (
    evaluate_task,
    filter_task,
    open_round_task,
    publish_task,
    record_round_task,
    rollout_task,
    train_task,
)
from storage.checkpoints import read_lineage
from storage.paths import StorageRoot
from tasks.rollout.overlap import NextPolicy, Overlapped, RolloutCancelled
from tasks.rollout.stage import carry_source
from tasks.round.context import RoundContext
from tasks.round.results import Evaluation, StageResult, Stats

OVERLAPPED_PARENT = "(registered while this rollout ran)"
"""An overlapped rollout's context holds this as its parent's registered version: the rollout starts
before the parent is registered, and never reads it (it is not part of what it generates)."""


class RoundResult(StageResult):
    """What a campaign keeps of a finished round."""

    round: int
    checkpoint: str
    model_version: str
    trajectory_version: str
    stats: Stats
    evaluation: Evaluation
    """Its checkpoint's held-out scores and the gate's verdict (also among ``stats``, as logged)."""
    resumed_stages: list[str]
    """Stages answered from their records (a resumed round)."""


class _Clock:
    """Wall seconds per stage, logged under time/."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._last = time.perf_counter()
        self._start = self._last

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.times[f"time/{stage}_s"] = now - self._last
        self._last = now

    def total(self) -> dict[str, float]:
        return {**self.times, "time/round_s": time.perf_counter() - self._start}


@flow(name="rl-round", flow_run_name="{run_id}-round-{round_index}", validate_parameters=True)
def rl_round(
    config: RoundConfig,
    storage: str,
    run_id: str,
    round_index: int,
    experiment: str,
    parent_checkpoint: str,
    parent_model_version: str,
    base_model: str,
    code_version: str,
    next_round: bool = False,
    stop_at_accuracy: float | None = None,
) -> RoundResult:
    """One round. ``next_round``: another round follows (overlap mode starts its rollout here);
    ``stop_at_accuracy``: the campaign stops after this round at that accuracy (so none follows)."""
    clock = _Clock()
    ctx = open_round(
        config,
        storage=storage,
        run_id=run_id,
        round_index=round_index,
        experiment=experiment,
        parent_checkpoint=parent_checkpoint,
        parent_model_version=parent_model_version,
        base_model=base_model,
        code_version=code_version,
    )
    stage = Stages(ctx)  # each stage runs once per (run, round, inputs); a resumed round skips the recorded ones
    clock.lap("open")

    # rollout + verify: each sample is scored as it finishes, until the trainable batch is full; the previous
    # round's carry-over (samples it stopped or had not verified) is resumed first
    overlap = config.mode == "overlap"
    collecting = StageProgress(
        "rollout",
        artifact_key(run_id, "round", round_index, "rollout"),
        f"round {round_index}: trainable groups collected",
    )
    if overlap and round_index >= 2:  # normally recorded already by the previous round, which ran it
        rollout = overlapped_rollout(stage, config, overlapped_context(ctx), collecting).pending.result()
        if "rollout" in stage.skipped:  # the previous round ran it: that is overlap, not a resume
            stage.skipped.remove("rollout")
    else:
        rollout = stage.run(
            "rollout",
            rollout_task,
            ctx=ctx,
            prompts=config.prompts,
            rollout=config.rollout,
            verify=config.verify_resolved,
            filtering=config.filter,
            target_groups=config.target_groups,
            carry_from=carry_source(storage, run_id, round_index),
            progress=collecting,
            device=config.device,
        )
    collecting.done()
    clock.lap("rollout")
    # filter + store: advantages and drop decisions, committed as this round's trajectory version together
    # with this round's own carry-over
    trajectories = stage.run(
        "filter",
        filter_task,
        ctx=ctx,
        staging=rollout.staging,
        config=config.filter,
        target_groups=config.target_groups,
        rollout_stats=rollout.stats,
        carryover=rollout.carryover,
    )
    clock.lap("filter")
    upcoming = None
    if overlap and next_round:  # the next round's rollout generates while this round trains
        upcoming = overlapped_rollout(
            Stages(next_ctx := next_context(ctx)),
            config,
            next_ctx,
            StageProgress(
                "rollout",
                artifact_key(run_id, "round", round_index + 1, "rollout"),
                f"round {round_index + 1}: trainable groups collected",
            ),
            start=ctx.parent_checkpoint,
        )
    try:
        trained = stage.run(
            "train",
            train_task,
            ctx=ctx,
            trajectory_uri=trajectories.uri,
            config=config.train,
            temperature=config.rollout.temperature,
            rollout_dtype=config.rollout.dtype,
            device=config.device,
            ray_address=config.rollout.ray_address,
        )
        if upcoming is not None:
            upcoming.next_policy.committed()
        clock.lap("train")
        published = stage.run(
            "publish",
            publish_task,
            ctx=ctx,
            config=config.publish_resolved,
            checkpoint=trained.checkpoint,
            trajectory_version=trajectories.version,
            trajectory_uri=trajectories.uri,
            committed_at=trained.committed_at,
            engine=config.rollout.engine,
            engine_dtype=config.rollout.dtype,
            max_batch=config.rollout.max_batch,
            load_engine=not overlap,
            device=config.device,
        )
        clock.lap("publish")
        evaluation = stage.run(
            "evaluate",
            evaluate_task,
            ctx=ctx,
            config=config.evaluate,
            prompts=config.prompts,
            verify=config.verify_resolved,
            checkpoint=trained.checkpoint,
            model_version=published.model_version,
            engine_role="evaluate" if overlap else "rollout",
            device=config.device,
        )
        if config.evaluate.approval == "required" and evaluation.gate_passed:
            # one stage: a resumed round whose decision is recorded does not ask again
            decided = stage.run(
                "promote",
                approve_and_promote,
                ctx=ctx,
                config=config.evaluate,
                model_version=published.model_version,
                evaluation=evaluation,
                champion_name=config.publish_resolved.registered_name,
            )
            evaluation = evaluation.decided(decided)
    except BaseException:
        if upcoming is not None:  # a rollout waiting for weights that will not come must not wait forever
            upcoming.next_policy.cancel(f"round {round_index} failed")
            upcoming.pending.abandon()
        raise
    clock.lap("evaluate")

    if upcoming is not None:
        if stop_at_accuracy is not None and evaluation.accuracy >= stop_at_accuracy:
            upcoming.next_policy.cancel(f"the campaign stops after round {round_index}")
            if not isinstance(error := upcoming.pending.abandon(), (RolloutCancelled, type(None))):
                raise error
        else:
            upcoming.pending.result()  # recorded under the next round
        clock.lap("next_rollout_wait")

    stats = {
        **rollout.stats,
        **trajectories.stats,
        **trained.stats,
        **published.stats,
        **evaluation.metrics(),
        **clock.total(),
        "resume/stages_skipped": len(stage.skipped),
    }
    stage.run(
        "record",
        record_round_task,
        ctx=ctx,
        stats=stats,
        model_version=published.model_version,
        trajectory_version=trajectories.version,
    )
    return RoundResult(
        round=round_index,
        checkpoint=trained.checkpoint,
        model_version=published.model_version,
        trajectory_version=trajectories.version,
        stats=stats,
        evaluation=evaluation,
        resumed_stages=stage.skipped,
    )


def open_round(
    config: RoundConfig,
    *,
    storage: str,
    run_id: str,
    round_index: int,
    experiment: str,
    parent_checkpoint: str,
    parent_model_version: str,
    base_model: str,
    code_version: str,
    params: dict | None = None,
) -> RoundContext:
    """Open round ``round_index``'s MLflow run (``params`` logged beside the config hash) and return the
    context its stages run under. The parent is round ``round_index - 1``'s policy; round 0, the base
    registered before any training, starts from itself (policy version 0)."""
    runs = open_round_task(
        storage=storage,
        experiment=experiment,
        run_id=run_id,
        round_index=round_index,
        params={"config_hash": config.config_hash(), **(params or {})},
    )
    return RoundContext(
        storage=storage,
        run_id=run_id,
        round=round_index,
        experiment=experiment,
        parent_checkpoint=parent_checkpoint,
        parent_policy_version=max(round_index - 1, 0),
        parent_model_version=parent_model_version,
        base_model=base_model,
        config_hash=config.config_hash(),
        code_version=code_version,
        flow_run_id=str(flow_run.id or "none"),
        mlflow_run_id=runs.round_run,
        seed=config.seed,
    )


@contextmanager
def without_heartbeat() -> Iterator[None]:
    """Flow runs started inside this block run without a heartbeat thread of their own.

    Prefect starts a heartbeat thread for every flow run and joins it when the run ends; the thread
    sleeps in whole seconds, so the join waits for up to one second after the run is done
    (``benchmarks/subflow_overhead.py``). A round is a subflow of the campaign, whose flow run keeps its
    heartbeat, so a server still learns that the process died."""
    with temporary_settings(updates={"flows.heartbeat_frequency": None}):
        yield


def run_round(config: RoundConfig, **kwargs) -> RoundResult:
    """``rl_round`` as a subflow of the calling flow, without a heartbeat of its own (``without_heartbeat``)."""
    with without_heartbeat():
        return rl_round(config, **kwargs)


# -- overlap mode ---------------------------------------------------------------------------------


@dataclass
class _Upcoming:
    """An overlapped rollout in flight, and the hand-over it waits on."""

    pending: PendingStage
    next_policy: NextPolicy


def overlapped_context(ctx: RoundContext) -> RoundContext:
    """The context an overlapped rollout of round ``ctx.round`` runs under (its stage record's key)."""
    return ctx.model_copy(update={"parent_model_version": OVERLAPPED_PARENT})


def next_context(ctx: RoundContext) -> RoundContext:
    """The next round's rollout context, as that round will build it, from this round's."""
    checkpoint = StorageRoot.of(ctx.storage).checkpoint(ctx.run_id, ctx.round)  # where train commits
    return overlapped_context(ctx).model_copy(
        update={
            "round": ctx.round + 1,
            "parent_checkpoint": checkpoint,
            "parent_policy_version": ctx.round,
            "mlflow_run_id": "(opened when its round starts)",
        }
    )


def overlapped_rollout(
    stage: Stages, config: RoundConfig, ctx: RoundContext, progress: StageProgress, start: str | None = None
) -> _Upcoming:
    """Round ``ctx.round``'s overlapped rollout, submitted: it starts from ``start``, the parent's parent
    (the newest checkpoint committed while the parent trains), and switches to the parent after
    ``config.update_after_samples`` finished samples. ``start`` None: the parent is committed already,
    and its parent is read from its lineage (a resumed campaign runs the rollout with the same start and
    switch point, and so to the same rows)."""
    next_policy = NextPolicy(ctx.storage, ctx.parent_checkpoint, ctx.parent_policy_version, config.update_after_samples)
    if start is None:
        next_policy.committed()
        start = read_lineage(StorageRoot.of(ctx.storage), ctx.parent_checkpoint)["parent_checkpoint"]
    pending = stage.submit(
        "rollout",
        rollout_task,
        ctx=ctx,
        prompts=config.prompts,
        rollout=config.rollout,
        verify=config.verify_resolved,
        filtering=config.filter,
        target_groups=config.target_groups,
        carry_from=carry_source(ctx.storage, ctx.run_id, ctx.round),
        progress=progress,
        overlap=Overlapped(start, ctx.parent_policy_version - 1, next_policy),
        device=config.device,
    )
    return _Upcoming(pending, next_policy)
