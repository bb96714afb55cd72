"""A campaign: round k+1 starts from round k's checkpoint. Round 0 is the base policy, evaluated once."""

from __future__ import annotations

import logging
import os
import subprocess
import time
import uuid

from prefect import flow
from prefect.runtime import flow_run

from flows.config import CampaignConfig
from flows.round import rl_round
from storage.settings import settings
from tasks.base import prepare_base_task, register_base_task
from tasks.context import RoundContext
from tasks.report import open_round_task

log = logging.getLogger("rlrounds")


def code_version() -> str:
    """The git commit of this code (with '+dirty' for uncommitted changes), else the package version."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=5).stdout.strip()
        return f"git:{sha}{'+dirty' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"rlrounds=={version('rlrounds')}"
        except PackageNotFoundError:
            return "unknown"


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


@flow(name="rl-campaign", validate_parameters=True)
def rl_campaign(config: CampaignConfig, storage: str | None = None) -> dict:
    storage = storage or settings().storage
    run_id = config.run_id or new_run_id()
    rc = config.round
    version = code_version()
    base = prepare_base_task(storage, rc.policy.base_model)
    runs = open_round_task(storage, config.experiment, run_id, 0, {"config_hash": rc.config_hash(), "rounds": config.rounds})
    ctx0 = RoundContext(
        storage=storage, run_id=run_id, round=0, experiment=config.experiment, parent_checkpoint=base["checkpoint"],
        parent_policy_version=0, parent_model_version="none", base_model=base["base_model"], config_hash=rc.config_hash(),
        code_version=version, flow_run_id=str(flow_run.id or "none"), mlflow_run_id=runs["round_run"], seed=rc.seed,
    )
    round0 = register_base_task(ctx0, rc.publish, rc.evaluate, rc.prompts, rc.verifier)
    log.info("round 0 (base %s): held-out accuracy %.1f%%", base["base_model"], 100 * round0["stats"]["eval/accuracy"])
    history = [{"round": 0, "model_version": round0["model_version"], "accuracy": round0["stats"]["eval/accuracy"]}]
    parent_checkpoint, parent_version = base["checkpoint"], round0["model_version"]
    for k in range(1, config.rounds + 1):
        result = rl_round(rc, storage, run_id, k, config.experiment, parent_checkpoint, parent_version, base["base_model"], version)
        s = result["stats"]
        log.info("round %d: mean reward %.3f, kept %d groups, held-out accuracy %.1f%%, %.1f s",
                 k, s["verify/mean_reward"], s["filter/kept_groups"], 100 * s["eval/accuracy"], s["time/round_s"])
        history.append({"round": k, "model_version": result["model_version"], "accuracy": s["eval/accuracy"],
                        "trajectory_version": result["trajectory_version"], "seconds": s["time/round_s"]})
        parent_checkpoint, parent_version = result["checkpoint"], result["model_version"]
        if config.stop_at_accuracy is not None and s["eval/accuracy"] >= config.stop_at_accuracy:
            log.info("stopping: accuracy %.1f%% reached stop_at_accuracy %.1f%%", 100 * s["eval/accuracy"], 100 * config.stop_at_accuracy)
            break
    return {"run_id": run_id, "storage": storage, "rounds": history, "final_model_version": parent_version}
