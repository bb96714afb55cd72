"""Replay and re-filter as Prefect flows: work on what rounds left behind, without new rollouts.

- ``rl-replay``: train on a stored trajectory version from a registered model version and publish the
  result with its lineage (tasks/campaign/replay.py).
- ``rl-refilter``: select rows of a trajectory version with an SQL predicate, optionally regroup, and
  commit a derived version (tasks/filter/refilter.py).
- ``rl-reverify``: score selected rows of a trajectory version again (by default its infrastructure
  failures, once the environment is fixed) into a derived version (tasks/filter/refilter.py).

Sequencing only. The parameters are pydantic models, so the Prefect UI renders them as forms.
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from flows.campaign import code_version
from flows.config import ReplayRequest, RoundConfig
from flows.resources import CampaignResources
from flows.tasks import plan_replay_task, publish_replay_task, refilter_task, reverify_task, train_task
from storage.settings import settings
from tasks.config.refilter import RefilterRequest, ReverifyRequest
from tasks.round.results import Reverified, TrajectoryVersion


@flow(name="rl-replay", validate_parameters=True)
def rl_replay(request: ReplayRequest, storage: str | None = None) -> dict:
    """Train on a stored trajectory version from a registered model version and publish the result.

    Args:
        request: What to replay (trajectory version), from which model version, with which config.
        storage: Storage root the rounds ran on. Default: $RLROUNDS_STORAGE.
    """
    storage = storage or settings().storage
    rc = request.config or RoundConfig()
    plan = plan_replay_task(
        storage=storage,
        trajectories=request.trajectories,
        from_model=request.from_model,
        train=request.config.train if request.config else None,
        config_hash=request.config.config_hash() if request.config else None,
        model_name=request.model_name,
        task=rc.prompts.task,
        line=rc.publish_resolved.line,
        code_version=code_version(),
        flow_run_id=str(flow_run.id or "none"),
    )
    with CampaignResources() as resources:  # engines and trainer workers do not outlive the replay
        trained = train_task(
            ctx=plan.context,
            trajectory_uri=plan.trajectory_uri,
            config=plan.train,
            temperature=plan.temperature,
            rollout_dtype=plan.rollout_dtype,
            lineage_extra=plan.lineage_extra,
            target_checkpoint=plan.checkpoint,
            engines=resources.engines,
            trainers=resources.trainers,
            device=rc.device,
            ray_address=rc.rollout.ray_address,
        )
        published = publish_replay_task(
            plan=plan,
            checkpoint=trained.checkpoint,
            train_stats=trained.stats,
            evaluate=rc.evaluate if request.evaluate else None,
            prompts=rc.prompts,
            verify=rc.verify_resolved,
            device=rc.device,
            **rc.agent,
        )
    return {
        "replay_id": plan.replay_id,
        "model_version": published.model_version,
        "checkpoint": trained.checkpoint,
        "trajectory_version": plan.trajectory_version,
        "from_model": request.from_model,
        "stats": published.stats,
        "accuracy": published.accuracy,
    }


@flow(name="rl-refilter", validate_parameters=True)
def rl_refilter(request: RefilterRequest, storage: str | None = None) -> TrajectoryVersion:
    """Select rows of a trajectory version with an SQL predicate and commit a derived version.

    Args:
        request: The version, the predicate, and whether to regroup.
        storage: Storage root the rounds ran on. Default: $RLROUNDS_STORAGE.
    """
    return refilter_task(storage=storage or settings().storage, request=request)


@flow(name="rl-reverify", validate_parameters=True)
def rl_reverify(request: ReverifyRequest, storage: str | None = None) -> Reverified:
    """Score selected rows of a trajectory version again and commit a derived version.

    Args:
        request: The version, which rows to verify again, and the verifier settings.
        storage: Storage root the rounds ran on. Default: $RLROUNDS_STORAGE.
    """
    return reverify_task(storage=storage or settings().storage, request=request)
