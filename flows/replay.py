"""Replay and re-filter as Prefect flows: work on what rounds left behind, without new rollouts.

- ``rl-replay``: train on a stored trajectory version from a registered model version and publish the
  result with its lineage (tasks/replay.py).
- ``rl-refilter``: select rows of a trajectory version with an SQL predicate, optionally regroup, and
  commit a derived version (tasks/refilter.py).

Sequencing only. The parameters are pydantic models, so the Prefect UI renders them as forms.
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict, field_validator

from flows.campaign import code_version
from flows.config import RoundConfig
from storage.settings import settings
from tasks.refilter import RefilterRequest, refilter_task
from tasks.replay import plan_replay_task, publish_replay_task
from tasks.train import train_task


class ReplayRequest(BaseModel):
    """What to replay, from where, with which config."""

    model_config = ConfigDict(extra="forbid")

    trajectories: str
    """Trajectory version id (or a unique prefix of at least 6 characters): a round's own or a derived one."""
    from_model: str
    """Registered model version to start from, 'NAME/VERSION'; its source is the checkpoint trained on."""
    config: RoundConfig | None = None
    """Round config whose train, prompts and evaluate sections the replay uses. Default: the training
    config recorded with the trajectories' round, and the default evaluation."""
    model_name: str | None = None
    """Registered model name for the result. Default: the parent's name."""
    evaluate: bool = True
    """Evaluate the replayed checkpoint (eval.* tags on its model version; the champion alias never moves)."""

    @field_validator("from_model")
    @classmethod
    def _name_slash_version(cls, v: str) -> str:
        name, _, version = v.rpartition("/")
        if not name or not version.isdigit():
            raise ValueError(f"from_model {v!r} must be a registered model version NAME/VERSION, e.g. rlrounds-policy/3")
        return v


@flow(name="rl-replay", validate_parameters=True)
def rl_replay(request: ReplayRequest, storage: str | None = None) -> dict:
    storage = storage or settings().storage
    rc = request.config or RoundConfig()
    plan = plan_replay_task(storage, request.trajectories, request.from_model,
                            request.config.train if request.config else None,
                            request.config.config_hash() if request.config else None,
                            request.model_name, rc.prompts.task, code_version(), str(flow_run.id or "none"))
    trained = train_task(plan.context, plan.trajectory_uri, plan.train, plan.temperature, plan.rollout_dtype,
                         lineage_extra=plan.lineage_extra, target_checkpoint=plan.checkpoint)
    published = publish_replay_task(plan, trained["checkpoint"], trained["stats"], rc.evaluate if request.evaluate else None,
                                    rc.prompts, rc.verifier)
    return {
        "replay_id": plan.replay_id,
        "model_version": published["model_version"],
        "checkpoint": trained["checkpoint"],
        "trajectory_version": plan.trajectory_version,
        "from_model": request.from_model,
        "stats": published["stats"],
    }


@flow(name="rl-refilter", validate_parameters=True)
def rl_refilter(request: RefilterRequest, storage: str | None = None) -> dict:
    return refilter_task(storage or settings().storage, request)
