"""Publication: register a committed checkpoint in the MLflow registry with its lineage, then have the
live rollout engine serve it.

Two costs are measured apart: ``publish/latency_s`` (checkpoint committed -> registered -> engine
serving it) and ``publish/engine_pause_s`` (the part of that during which the engine could not serve).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import field_validator

from tasks.config_base import Config
from tasks.context import RoundContext
from tasks.results import NotInput, Published


class PublishConfig(Config):
    """Where checkpoints are registered."""

    model_name: str = "rlrounds-policy"
    """Registered model name in the MLflow registry."""
    register_base: bool = True
    """Register the starting policy as version 'round 0', so every lineage walk ends at a registered base."""

    @field_validator("model_name")
    @classmethod
    def _no_slash(cls, v: str) -> str:
        if not v or "/" in v or "'" in v:
            raise ValueError(f"model_name {v!r} must be non-empty without '/' or quotes (lineage uses NAME/VERSION)")
        return v


def lineage_tags(
    *,
    round_index: int,
    run_id: str,
    parent_model_version: str,
    trajectory_version: str,
    base_model: str,
    config_hash: str,
    code_version: str,
    prefect_flow_run_id: str,
) -> dict[str, str]:
    """The tags every registered checkpoint carries (DESIGN.md, Lineage)."""
    return {
        "round": str(round_index),
        "run_id": run_id,
        "parent_model_version": parent_model_version,
        "trajectory_version": trajectory_version,
        "base_model": base_model,
        "config_hash": config_hash,
        "code_version": code_version,
        "prefect_flow_run_id": prefect_flow_run_id,
    }


# -- the stage ------------------------------------------------------------------------------------


def run_publish(
    *,
    ctx: RoundContext,
    config: PublishConfig,
    checkpoint: str,
    trajectory_version: str,
    trajectory_uri: str,
    committed_at: Annotated[float | None, NotInput("a measurement: when train committed")],
    engine: str,
    engine_dtype: str,
    max_batch: int,
) -> Published:
    """Register the checkpoint with its lineage tags, then load it into the live rollout engine
    (``engine`` at ``engine_dtype``, the round's rollout engine)."""
    import time

    from storage import checkpoints
    from storage.lineage import Tracker
    from storage.paths import StorageRoot
    from storage.settings import settings
    from tasks.engines import serving_engine

    start = time.time()
    committed_at = committed_at or start
    root = StorageRoot.of(ctx.storage)
    tracker = Tracker.connect(settings(), root)
    tracker.log_dataset(
        ctx.mlflow_run_id, f"trajectories-{ctx.run_id}-r{ctx.round}", trajectory_version, trajectory_uri
    )
    tags = lineage_tags(
        round_index=ctx.round,
        run_id=ctx.run_id,
        parent_model_version=ctx.parent_model_version,
        trajectory_version=trajectory_version,
        base_model=ctx.base_model,
        config_hash=ctx.config_hash,
        code_version=ctx.code_version,
        prefect_flow_run_id=ctx.flow_run_id,
    )
    version = tracker.register(config.model_name, checkpoint, ctx.mlflow_run_id, tags)
    registered = time.time()
    local = checkpoints.local_copy(root, checkpoint)
    _, _, pause = serving_engine(engine, local, engine_dtype, ctx.round, max_batch)
    serving = time.time()
    return Published(
        model_version=f"{config.model_name}/{version}",
        stats={
            "publish/latency_s": serving - committed_at,
            "publish/register_s": registered - start,
            "publish/engine_pause_s": pause,
        },
    )
