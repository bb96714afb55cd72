"""One RL round as a Prefect flow: rollout -> verify -> filter -> store -> train -> publish -> evaluate.

Sequencing only: every stage is a task that takes URIs and configs by keyword and returns a typed
result (tasks/results.py) of URIs and small stats. Rollout verifies each sample as it finishes
(verification overlaps generation); filter commits the trajectory version to the store.
"""

from __future__ import annotations

import time

from prefect import flow
from prefect.runtime import flow_run

from flows.approval import approve_and_promote
from flows.config import RoundConfig
from flows.progress import StageProgress, artifact_key
from flows.stages import Stages
from flows.tasks import (
    evaluate_task,
    filter_task,
    open_round_task,
    publish_task,
    record_round_task,
    rollout_task,
    train_task,
)
from tasks.context import RoundContext
from tasks.results import StageResult, Stats
from tasks.rollout import carry_source


class RoundResult(StageResult):
    """What a campaign keeps of a finished round."""

    round: int
    checkpoint: str
    model_version: str
    trajectory_version: str
    stats: Stats
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
def rl_round(config: RoundConfig, storage: str, run_id: str, round_index: int, experiment: str, parent_checkpoint: str,
             parent_model_version: str, base_model: str, code_version: str) -> RoundResult:
    clock = _Clock()
    runs = open_round_task(storage=storage, experiment=experiment, run_id=run_id, round_index=round_index,
                           params={"config_hash": config.config_hash()})
    ctx = RoundContext(
        storage=storage, run_id=run_id, round=round_index, experiment=experiment, parent_checkpoint=parent_checkpoint,
        parent_policy_version=round_index - 1, parent_model_version=parent_model_version, base_model=base_model,
        config_hash=config.config_hash(), code_version=code_version, flow_run_id=str(flow_run.id or "none"),
        mlflow_run_id=runs.round_run, seed=config.seed,
    )
    stage = Stages(ctx)  # each stage runs once per (run, round, inputs); a resumed round skips the recorded ones
    clock.lap("open")

    # rollout + verify: each sample is scored as it finishes, until the trainable batch is full; the previous
    # round's carry-over (samples it stopped or had not verified) is resumed first
    collecting = StageProgress("rollout", artifact_key(run_id, "round", round_index, "rollout"),
                               f"round {round_index}: trainable groups collected")
    rollout = stage.run("rollout", rollout_task, ctx=ctx, prompts=config.prompts, rollout=config.rollout,
                        verify=config.verify_resolved, filtering=config.filter, target_groups=config.target_groups,
                        carry_from=carry_source(storage, run_id, round_index),
                        progress=collecting)
    collecting.done()
    clock.lap("rollout")
    # filter + store: advantages and drop decisions, committed as this round's trajectory version together
    # with this round's own carry-over
    trajectories = stage.run("filter", filter_task, ctx=ctx, staging=rollout.staging, config=config.filter,
                             target_groups=config.target_groups, rollout_stats=rollout.stats,
                             carryover=rollout.carryover)
    clock.lap("filter")
    trained = stage.run("train", train_task, ctx=ctx, trajectory_uri=trajectories.uri, config=config.train,
                        temperature=config.rollout.temperature, rollout_dtype=config.rollout.dtype)
    clock.lap("train")
    published = stage.run("publish", publish_task, ctx=ctx, config=config.publish_resolved,
                          checkpoint=trained.checkpoint, trajectory_version=trajectories.version,
                          trajectory_uri=trajectories.uri,
                          committed_at=trained.committed_at, engine=config.rollout.engine,
                          engine_dtype=config.rollout.dtype, max_batch=config.rollout.max_batch)
    clock.lap("publish")
    evaluation = stage.run("evaluate", evaluate_task, ctx=ctx, config=config.evaluate, prompts=config.prompts,
                           verify=config.verify_resolved, checkpoint=trained.checkpoint,
                           model_version=published.model_version)
    if config.evaluate.approval == "required" and evaluation.stats.get("eval/gate_passed"):
        # one stage: a resumed round whose decision is recorded does not ask again
        decided = stage.run("promote", approve_and_promote, ctx=ctx, config=config.evaluate,
                            model_version=published.model_version, stats=evaluation.stats,
                            champion_name=config.publish_resolved.registered_name)
        evaluation = evaluation.model_copy(update={"stats": {**evaluation.stats, **decided.stats}})
    clock.lap("evaluate")

    stats = {**rollout.stats, **trajectories.stats, **trained.stats, **published.stats, **evaluation.stats,
             **clock.total(), "resume/stages_skipped": len(stage.skipped)}
    stage.run("record", record_round_task, ctx=ctx, stats=stats, model_version=published.model_version,
              trajectory_version=trajectories.version)
    return RoundResult(round=round_index, checkpoint=trained.checkpoint, model_version=published.model_version,
                       trajectory_version=trajectories.version, stats=stats, resumed_stages=stage.skipped)
