"""One RL round as a Prefect flow: rollout -> verify -> filter -> store -> train -> publish -> evaluate.

Sequencing only: every stage is a task that takes URIs and configs and returns URIs and small stats.
"""

from __future__ import annotations

import time

from prefect import flow
from prefect.runtime import flow_run

from flows.config import RoundConfig
from flows.stages import Stages
from tasks.context import RoundContext
from tasks.evaluate import evaluate_task
from tasks.filter import filter_task
from tasks.publish import publish_task
from tasks.report import open_round_task, record_round_task
from tasks.rollout import rollout_task
from tasks.train import train_task


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
def rl_round(config: RoundConfig, storage: str, run_id: str, round_index: int, experiment: str,
             parent_checkpoint: str, parent_model_version: str, base_model: str, code_version: str) -> dict:
    clock = _Clock()
    runs = open_round_task(storage, experiment, run_id, round_index, {"config_hash": config.config_hash()})
    ctx = RoundContext(
        storage=storage, run_id=run_id, round=round_index, experiment=experiment,
        parent_checkpoint=parent_checkpoint, parent_policy_version=round_index - 1,
        parent_model_version=parent_model_version, base_model=base_model, config_hash=config.config_hash(),
        code_version=code_version, flow_run_id=str(flow_run.id or "none"), mlflow_run_id=runs["round_run"], seed=config.seed,
    )
    stage = Stages(ctx)  # each stage runs once per (run, round, inputs); a resumed round skips the recorded ones
    clock.lap("open")
    rollout = stage.run("rollout", rollout_task, ctx, config.prompts, config.rollout, config.verify, config.filter, config.target_groups)
    clock.lap("rollout")
    trajectories = stage.run("filter", filter_task, ctx, rollout["staging"], config.filter, config.target_groups, rollout["stats"])
    clock.lap("filter")
    trained = stage.run("train", train_task, ctx, trajectories["uri"], config.train, config.rollout.temperature, config.rollout.dtype)
    clock.lap("train")
    published = stage.run("publish", publish_task, ctx, config.publish, trained["checkpoint"], trajectories["version"],
                          trajectories["uri"], trained["committed_at"], config.rollout.engine, config.rollout.dtype,
                          config.rollout.max_batch)
    clock.lap("publish")
    evaluation = stage.run("evaluate", evaluate_task, ctx, config.evaluate, config.prompts, config.verifier, trained["checkpoint"],
                           published["model_version"])
    clock.lap("evaluate")
    stats = {**rollout["stats"], **trajectories["stats"], **trained["stats"], **published["stats"], **evaluation, **clock.total(),
             "resume/stages_skipped": len(stage.skipped)}
    stage.run("record", record_round_task, storage, runs["round_run"], run_id, round_index, stats, published["model_version"],
              trajectories["version"])
    return {
        "round": round_index,
        "checkpoint": trained["checkpoint"],
        "model_version": published["model_version"],
        "trajectory_version": trajectories["version"],
        "stats": stats,
        "resumed_stages": stage.skipped,
    }
