"""One RL round as a Prefect flow: rollout -> verify -> filter -> store -> train -> publish -> evaluate.

Sequencing only: every stage is a task that takes URIs and configs by keyword and returns a typed
result (tasks/round/results.py) of URIs and small stats. Rollout verifies each sample as it finishes
(verification overlaps generation); filter commits the trajectory version to the store.

The round's mode (flows/overlap.py) is asked at the points where ``round.mode: overlap`` differs from ``sync``:
which rollout the round filters, what starts beside training, which engine evaluates. The live engines and the
trainer's worker group are the campaign's (flows/resources.py), passed in; a round run on its own opens its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import flow
from prefect.runtime import flow_run
from prefect.settings import temporary_settings

from flows.approval import approve_and_promote
from flows.config import RoundConfig
from flows.overlap import OverlapMode, SyncMode
from flows.progress import StageProgress, artifact_key
from flows.resources import CampaignResources, held
from flows.stages import Stages
from flows.tasks import evaluate_task, filter_task, open_round_task, publish_task, record_round_task, train_task
from tasks.round.context import RoundContext
from tasks.round.results import Evaluation, StageResult, Stats


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
    resources: CampaignResources | None = None,
) -> RoundResult:
    """One round. ``next_round``: another round follows (overlap mode starts its rollout here);
    ``stop_at_accuracy``: the campaign stops after this round at that accuracy (so none follows);
    ``resources``: the calling campaign's live engines and worker group (empty: the round opens its own and
    releases them when it ends)."""
    with held(resources) as resources:
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
        engines = resources.engines
        mode = (OverlapMode if config.mode == "overlap" else SyncMode)(stage, config, ctx, engines)
        clock.lap("open")

        # rollout + verify: each sample is scored as it finishes, until the trainable batch is full; the previous
        # round's carry-over (samples it stopped or had not verified) is resumed first
        collecting = StageProgress(
            "rollout",
            artifact_key(run_id, "round", round_index, "rollout"),
            f"round {round_index}: trainable groups collected",
        )
        rollout = mode.rollout(collecting)
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
        if next_round:
            mode.start_next_rollout()  # overlap: the next round's rollout generates while this round trains
        try:
            trained = stage.run(
                "train",
                train_task,
                ctx=ctx,
                trajectory_uri=trajectories.uri,
                config=config.train,
                temperature=config.rollout.temperature,
                rollout_dtype=config.rollout.dtype,
                engines=engines,
                trainers=resources.trainers,
                device=config.device,
                ray_address=config.rollout.ray_address,
            )
            mode.trained()
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
                engines=engines,
                load_engine=mode.publish_loads_engine,
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
                **config.agent,
                checkpoint=trained.checkpoint,
                model_version=published.model_version,
                engines=engines,
                engine_role=mode.evaluation_role,
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
            mode.abandon(f"round {round_index} failed")
            raise
        clock.lap("evaluate")
        if mode.finish(stop=stop_at_accuracy is not None and evaluation.accuracy >= stop_at_accuracy):
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
