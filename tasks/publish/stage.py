"""Publication: register a committed checkpoint in the MLflow registry with its lineage, then have the
live rollout engine serve it.

Two costs are measured apart: ``publish/latency_s`` (checkpoint committed -> registered -> engine
serving it) and ``publish/engine_pause_s`` (the part of that during which the engine could not serve).
On GPUs a vLLM engine takes the weights from the trainer's memory when the trainer offered them
(``LiveEngines.offer_weights``, tasks/serving/live.py), not from the checkpoint files;
``publish/weights_from_memory`` says which (1 or 0). The checkpoint is written and registered either way:
lineage reads it.
"""

from __future__ import annotations

import time
from typing import Annotated

from storage import checkpoints
from storage.paths import StorageRoot
from storage.settings import settings
from storage.tracking import LINE_TAG, Tracker
from tasks.config.base import NotInput
from tasks.config.publish import PublishConfig
from tasks.round.context import RoundContext
from tasks.round.results import Published
from tasks.serving.live import LiveEngines, takes_weights_from_memory


def lineage_tags(ctx: RoundContext, *, trajectory_version: str, line: str) -> dict[str, str]:
    """The tags every registered checkpoint carries (DESIGN.md, Lineage), and its promotion line: the
    round's identity comes from its context, so every registration tags the same fields the same way."""
    return {
        LINE_TAG: line,
        "round": str(ctx.round),
        "run_id": ctx.run_id,
        "parent_model_version": ctx.parent_model_version,
        "trajectory_version": trajectory_version,
        "base_model": ctx.base_model,
        "config_hash": ctx.config_hash,
        "code_version": ctx.code_version,
        "prefect_flow_run_id": ctx.flow_run_id,
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
    engines: Annotated[LiveEngines, NotInput("the live engines of the flow that runs the round")],
    load_engine: Annotated[
        bool, NotInput("overlap mode: the next round's rollout loads the weights itself, mid-generation")
    ] = True,
    device: Annotated[str, NotInput("where the live engine computes")] = "auto",
) -> Published:
    """Register the checkpoint with its lineage tags, then load it into the live rollout engine of ``engines``
    (``engine`` at ``engine_dtype`` on ``device``, the round's rollout engine). ``load_engine`` False (overlap mode):
    register only; the running rollout takes the weights (its ``rollout/weight_update_*`` figures)."""
    start = time.time()
    committed_at = committed_at or start
    root = StorageRoot.of(ctx.storage)
    tracker = Tracker.connect(settings(), root)
    tracker.log_dataset(
        ctx.mlflow_run_id, f"trajectories-{ctx.run_id}-r{ctx.round}", trajectory_version, trajectory_uri
    )
    tags = lineage_tags(ctx, trajectory_version=trajectory_version, line=config.line or "")
    trained_on = checkpoints.read_lineage(root, checkpoint).get("trained_on") or {}  # workers, device, precision
    tags.update({f"trained_on.{key}": str(value) for key, value in trained_on.items()})
    name = config.registered_name
    version = tracker.register(name, checkpoint, ctx.mlflow_run_id, tags)
    registered = time.time()
    stats = {"publish/register_s": registered - start}
    # taken in either mode: in overlap mode the next rollout reads the checkpoint, and an offer left here would keep
    # the trainer's weights on its GPU until the next round's offer replaced it
    weights = engines.take_offered(checkpoint)
    if load_engine:
        local = checkpoints.local_copy(root, checkpoint)
        served, _, stats["publish/engine_pause_s"] = engines.serve(
            engine,
            local,
            dtype=engine_dtype,
            policy_version=ctx.round,
            max_batch=max_batch,
            weights=weights,
            device=device,
        )
        stats["publish/weights_from_memory"] = float(weights is not None and takes_weights_from_memory(served))
    del weights  # the trainer's tensors: released with the stage, used or not
    stats["publish/latency_s"] = time.time() - committed_at
    return Published(model_version=f"{name}/{version}", stats=stats)
