"""A campaign: round k+1 starts from round k's checkpoint. Round 0 is the base policy, evaluated once.

Crash-safe: inputs are checked before anything is written, then the campaign is claimed (one writer
per run id), and every stage of every round runs once per (run, round, stage, inputs). Re-running the
flow with the same run_id, or ``rlrounds run --resume RUN_ID``, continues from the last committed stage.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import time
import uuid
from importlib.metadata import PackageNotFoundError, version

from prefect import flow

from flows.config import CampaignConfig
from flows.progress import StageProgress, artifact_key, publish_rounds_table, stage_logger
from flows.resources import CampaignResources
from flows.round import open_round, run_round
from flows.stages import Stages
from flows.tasks import preflight_task, prepare_base_task, register_base_task
from storage.campaigns import Owner, assert_owner, claim, release
from storage.paths import StorageRoot
from storage.settings import settings
from tasks.campaign.start import StartPoint

log = logging.getLogger("rlrounds")


def code_version() -> str:
    """Which code and which dependency set trained a checkpoint: the code part, then ``deps:`` and a hash
    of the installed lock (constraints.txt) when the code runs from a checkout that has one.

    The code part is $RLROUNDS_CODE_VERSION (images built without .git), else the git commit of this
    code (with '+dirty' for uncommitted changes), else the package version."""
    deps = dependency_lock_hash()
    return f"{_code_part()} deps:{deps}" if deps else _code_part()


def dependency_lock_hash(path: str | None = None) -> str | None:
    """sha256 prefix of the dependency lock beside this code (None when it is not there, e.g. a wheel)."""
    path = path or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "constraints.txt")
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:12]
    except OSError:
        return None


def _code_part() -> str:
    if os.environ.get("RLROUNDS_CODE_VERSION"):
        return os.environ["RLROUNDS_CODE_VERSION"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        # --no-optional-locks: reading the status must never take the index lock from a concurrent git user
        dirty = subprocess.run(
            ["git", "--no-optional-locks", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return f"git:{sha}{'+dirty' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        try:
            return f"rlrounds=={version('rlrounds')}"
        except PackageNotFoundError:
            return "unknown"


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


@flow(name="rl-campaign", validate_parameters=True)
def rl_campaign(
    config: CampaignConfig = CampaignConfig(),  # noqa: B008 -- a frozen default the UI shows filled in
    storage: str | None = None,
    resume: bool | None = None,
    takeover: bool = False,
) -> dict:
    """A campaign of RL rounds, each starting from the previous round's checkpoint.

    Args:
        config: Rounds to run, the campaign's run id, and everything one round does.
        storage: Storage root (a directory or s3://bucket/prefix). Default: $RLROUNDS_STORAGE.
        resume: False for a new run id (`rlrounds run --run-id`), True for an existing one (`--resume`),
            empty for either: re-running with the same run id continues the campaign.
        takeover: Resume even though the recorded owner runs on another host, which this one cannot check.
    """
    root = StorageRoot.of(storage or settings().storage)
    storage = root.uri
    config = config.model_copy(update={"run_id": config.run_id or new_run_id()})
    run_id = config.run_id
    mode = {None: "auto", True: "resume", False: "new"}[resume]
    claim(root, run_id, config.model_dump(mode="json"), config.identity(), mode, takeover, dry_run=True)
    preflight_task(
        config=config.round, storage=storage
    )  # inputs first: a campaign that cannot run leaves nothing behind
    owner = claim(root, run_id, config.model_dump(mode="json"), config.identity(), mode, takeover)
    if owner.generation:
        log.info("resuming campaign %s (takeover %d)", run_id, owner.generation)
    try:
        with CampaignResources() as resources:  # the engines and trainer workers live as long as the campaign
            return campaign_rounds(
                config, storage=storage, run_id=run_id, version=code_version(), owner=owner, resources=resources
            )
    finally:
        release(owner)


def campaign_rounds(
    config: CampaignConfig, *, storage: str, run_id: str, version: str, owner: Owner, resources: CampaignResources
) -> dict:
    """Round 0 (the base policy, registered and evaluated once), then rounds 1 to ``config.rounds``, with the
    campaign's live engines and worker group (``resources``)."""
    rc = config.round
    building = StageProgress("base build", artifact_key(run_id, "base-build"), "building the base policy")
    stage_logger().info("base policy %s: preparing (built on first use, then cached)", rc.policy.base_model)
    base = prepare_base_task(storage=storage, base_model=rc.policy.base_model, progress=building, device=rc.device)
    building.done()
    ctx0 = open_round(
        rc,
        storage=storage,
        run_id=run_id,
        round_index=0,
        experiment=config.experiment,
        parent_checkpoint=base.checkpoint,
        parent_model_version="none",
        base_model=base.base_model,
        code_version=version,
        params={"rounds": config.rounds},
    )
    round0 = Stages(ctx0).run(
        "base",
        register_base_task,
        ctx=ctx0,
        publish=rc.publish_resolved,
        evaluate=rc.evaluate,
        prompts=rc.prompts,
        verify=rc.verify_resolved,
        **rc.agent,
        engines=resources.engines,
        device=rc.device,
    )
    log.info("round 0 (base %s): held-out accuracy %.1f%%", base.base_model, 100 * round0.accuracy)
    history = [{"round": 0, "model_version": round0.model_version, "accuracy": round0.accuracy}]
    publish_rounds_table(run_id, history)
    registered_base = StartPoint(
        model_version=round0.model_version, checkpoint=base.checkpoint, round=0, base_model=base.base_model
    )
    final_version = run_rounds(
        config,
        storage=storage,
        run_id=run_id,
        version=version,
        owner=owner,
        start=registered_base,
        history=history,
        resources=resources,
    )
    return {"run_id": run_id, "storage": storage, "rounds": history, "final_model_version": final_version}


def run_rounds(
    config: CampaignConfig,
    *,
    storage: str,
    run_id: str,
    version: str,
    owner: Owner,
    start: StartPoint,
    history: list[dict],
    resources: CampaignResources,
) -> str:
    """Rounds ``start.round + 1`` to ``start.round + config.rounds``, the first from ``start``, each
    next one from the previous one's checkpoint, until ``config.stop_at_accuracy`` is reached. Each
    finished round is added to ``history`` (and the rounds table); returns the last model version."""
    last = start.round + config.rounds
    parent_checkpoint, parent_version = start.checkpoint, start.model_version
    rc = config.round
    if rc.train.workers > 1 and last > start.round:  # before any rollout replica takes the cluster's free CPUs
        resources.trainers.group(rc.train.workers, rc.device, rc.rollout.ray_address)
    for k in range(start.round + 1, last + 1):
        assert_owner(StorageRoot.of(storage), run_id, owner)  # a process that lost a takeover stops here
        result = run_round(
            config.round,
            storage=storage,
            run_id=run_id,
            round_index=k,
            experiment=config.experiment,
            parent_checkpoint=parent_checkpoint,
            parent_model_version=parent_version,
            base_model=start.base_model,
            code_version=version,
            next_round=k < last,
            stop_at_accuracy=config.stop_at_accuracy,
            resources=resources,
        )
        s = result.stats
        log.info("%s", round_line(k, s, result.evaluation.accuracy, result.resumed_stages))
        history.append(
            {
                "round": k,
                "model_version": result.model_version,
                "accuracy": result.evaluation.accuracy,
                "trajectory_version": result.trajectory_version,
                "checkpoint": result.checkpoint,
                "seconds": s["time/round_s"],
                "reward": s.get("verify/mean_reward"),
                "kept_groups": s.get("filter/kept_groups"),
                "stage_seconds": {key.removeprefix("time/"): v for key, v in s.items() if key.startswith("time/")},
                # the engine's generating seconds (overlap mode: less its wait for the trainer's weights)
                "generating_s": s.get("rollout/wall_s", 0.0) - s.get("rollout/weight_update_wait_s", 0.0),
            }
        )
        publish_rounds_table(run_id, history)
        parent_checkpoint, parent_version = result.checkpoint, result.model_version
        if config.stop_at_accuracy is not None and result.evaluation.accuracy >= config.stop_at_accuracy:
            log.info(
                "stopping: accuracy %.1f%% reached stop_at_accuracy %.1f%%",
                100 * result.evaluation.accuracy,
                100 * config.stop_at_accuracy,
            )
            break
    return parent_version


def round_line(k: int, s: dict, accuracy: float, resumed_stages: list[str]) -> str:
    """The one line a finished round prints. A resumed round may lack figures of stages it skipped."""
    nan = float("nan")
    line = (
        f"round {k}: mean reward {s.get('verify/mean_reward', nan):.3f}, kept {s.get('filter/kept_groups', nan):.0f} "
        "groups, "
        f"held-out accuracy {100 * accuracy:.1f}%, {s['time/round_s']:.1f} s"
    )
    return f"{line} (resumed: {', '.join(resumed_stages)} already committed)" if resumed_stages else line
