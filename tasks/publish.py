"""Publication: register a committed checkpoint in the MLflow registry with its lineage, then have the
live rollout engine serve it.

Two costs are measured apart: ``publish/latency_s`` (checkpoint committed -> registered -> engine
serving it) and ``publish/engine_pause_s`` (the part of that during which the engine could not serve).
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from typing import Annotated

from pydantic import field_validator

from storage.tracking import LINE_TAG
from tasks.config_base import Config
from tasks.context import RoundContext
from tasks.results import NotInput, Published


class PublishConfig(Config):
    """Where checkpoints are registered, and which promotion line they belong to."""

    model_name: str | None = None
    """Registered model name in the MLflow registry. Default: 'rlrounds-<line>', one registered model (and
    so one champion) per promotion line."""
    line: str | None = None
    """Promotion line: the checkpoints the champion gate compares, all evaluated on one task and held-out
    set. Default: the prompts' task ('addition', 'longtail'), followed by the held-out file's name and a
    hash of its URI when evaluate.source is set ('addition-heldout-1a2b3c4d')."""
    register_base: bool = True
    """Register the starting policy as version 'round 0', so every lineage walk ends at a registered base."""

    @field_validator("model_name")
    @classmethod
    def _no_slash(cls, v: str | None) -> str | None:
        if v is not None and (not v or "/" in v or "'" in v):
            raise ValueError(f"model_name {v!r} must be non-empty without '/' or quotes (lineage uses NAME/VERSION)")
        return v

    @field_validator("line")
    @classmethod
    def _line_safe(cls, v: str | None) -> str | None:
        if v is not None and not LINE_PATTERN.match(v):
            raise ValueError(
                f"publish.line {v!r} must be 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return v

    def resolved(self, task: str, held_out_source: str | None) -> PublishConfig:
        """This section with its line and model name filled in (RoundConfig.publish_resolved calls it)."""
        line = self.line or promotion_line(task, held_out_source)
        return self.model_copy(update={"line": line, "model_name": self.model_name or f"{DEFAULT_NAME_PREFIX}{line}"})

    @property
    def registered_name(self) -> str:
        if self.model_name is None or self.line is None:
            raise ValueError("publish needs its line and model name resolved; pass RoundConfig.publish_resolved")
        return self.model_name


DEFAULT_NAME_PREFIX = "rlrounds-"
LINE_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def promotion_line(task: str, held_out_source: str | None) -> str:
    """The line of a campaign that trains on ``task`` and is evaluated on ``held_out_source`` (None: the
    built-in task's fixed held-out set, which the task name already identifies).

    A held-out file is named by its stem and a hash of its URI, so two files that share a name are two
    lines, while a line name stays readable in the registry."""
    line = _slug(task, 60) or "task"
    if held_out_source:
        stem = posixpath.basename(held_out_source.rstrip("/")).rsplit(".", 1)[0]
        digest = hashlib.sha256(held_out_source.encode()).hexdigest()[:8]
        line = f"{line}-{_slug(stem, 30) or 'heldout'}-{digest}"
    return line


def _slug(text: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:limit]


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
    load_engine: Annotated[
        bool, NotInput("overlap mode: the next round's rollout loads the weights itself, mid-generation")
    ] = True,
) -> Published:
    """Register the checkpoint with its lineage tags, then load it into the live rollout engine
    (``engine`` at ``engine_dtype``, the round's rollout engine). ``load_engine`` False (overlap mode):
    register only; the running rollout takes the weights (its ``rollout/weight_update_*`` figures)."""
    import time

    from storage import checkpoints
    from storage.paths import StorageRoot
    from storage.settings import settings
    from storage.tracking import Tracker
    from tasks.engines import serving_engine

    start = time.time()
    committed_at = committed_at or start
    root = StorageRoot.of(ctx.storage)
    tracker = Tracker.connect(settings(), root)
    tracker.log_dataset(
        ctx.mlflow_run_id, f"trajectories-{ctx.run_id}-r{ctx.round}", trajectory_version, trajectory_uri
    )
    tags = lineage_tags(ctx, trajectory_version=trajectory_version, line=config.line or "")
    name = config.registered_name
    version = tracker.register(name, checkpoint, ctx.mlflow_run_id, tags)
    registered = time.time()
    stats = {"publish/register_s": registered - start}
    if load_engine:
        local = checkpoints.local_copy(root, checkpoint)
        _, _, stats["publish/engine_pause_s"] = serving_engine(engine, local, engine_dtype, ctx.round, max_batch)
    stats["publish/latency_s"] = time.time() - committed_at
    return Published(model_version=f"{name}/{version}", stats=stats)
