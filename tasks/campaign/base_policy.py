"""The starting policy of a campaign: a built-in one (built once, cached under the storage root) or
any Hugging Face causal-LM directory, checked before the campaign does anything else."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from typing import Annotated

from models.builtin import BUILTINS
from models.builtin.base_policy import build_base_policy
from models.checkpoint import check_policy_dir
from models.device import resolve_device
from storage import checkpoints
from storage.files import lease
from storage.paths import StorageRoot
from storage.settings import settings
from storage.tracking import Tracker
from tasks.config.base import AddedInput, NotInput
from tasks.config.environment import EpisodeConfig
from tasks.config.evaluate import EvaluateConfig
from tasks.config.prompts import PromptsConfig
from tasks.config.publish import PublishConfig
from tasks.config.verify import VerifyConfig
from tasks.evaluate.stage import run_evaluate
from tasks.publish.stage import lineage_tags
from tasks.round.context import RoundContext
from tasks.round.report import report_progress
from tasks.round.results import BasePolicy, Published
from tasks.serving.live import LiveEngines

BUILTIN = "builtin"  # the addition base; every built-in base is listed in models.builtin.BUILTINS
BASE_BUILD_LEASE_S = 4 * 3600.0
"""How long a base build may hold its lease: a holder on another host that died blocks the build that
long (one on this host is seen to be gone at once), so it is far above a build's minutes."""


def run_prepare_base(
    *, storage: str, base_model: str, progress: Callable[[str], None] | None = None, device: str = "auto"
) -> BasePolicy:
    """The base checkpoint URI and its identity (recorded as every checkpoint's base_model tag). A built-in base
    not built yet is trained on ``device``; once committed it is every later campaign's on that root, wherever
    they compute (a campaign resumed on another machine starts from the base it started from)."""
    placed = resolve_device(device)  # a device this machine lacks fails before a lease is taken
    root = StorageRoot.of(storage)
    if base_model not in BUILTINS:
        check_policy_dir(base_model)
        with open(os.path.join(base_model, "config.json"), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:12]
        return BasePolicy(
            checkpoint=os.path.abspath(base_model), base_model=f"{os.path.abspath(base_model)}@{digest}", built=False
        )
    builtin = BUILTINS[base_model]
    name = builtin.cache_name
    target = root.base_policy(name)
    built = False
    if not checkpoints.is_committed(root, target):
        progress = progress or report_progress
        # Campaigns started together on a fresh root build the base once: the first takes the lease and
        # builds, the others wait for it and find the base committed.
        progress(f"base policy {name}: building it, or waiting for the process that is")
        with lease(root, root.lock(f"base-{name}"), ttl_s=BASE_BUILD_LEASE_S, wait_s=BASE_BUILD_LEASE_S, poll_s=1.0):
            if not checkpoints.is_committed(root, target):
                with tempfile.TemporaryDirectory(prefix="rlrounds-base-") as tmp:
                    meta = build_base_policy(tmp, progress=progress, task=builtin, device=placed)
                    checkpoints.commit_checkpoint(root, tmp, target, {"kind": "base", **meta})
                built = True
    return BasePolicy(checkpoint=target, base_model=name, built=built)


def run_register_base(
    *,
    ctx: RoundContext,
    publish: PublishConfig,
    evaluate: EvaluateConfig,
    prompts: PromptsConfig,
    verify: VerifyConfig,
    environment: Annotated[str | None, AddedInput(since="2026-12-04", keyed_at_default=False)] = None,
    episode: Annotated[EpisodeConfig | None, AddedInput(since="2026-12-04", keyed_at_default=False)] = None,
    engines: Annotated[LiveEngines, NotInput("the live engines of the campaign")],
    device: Annotated[
        str, NotInput("where it computes: a campaign resumed on another machine is not scored again")
    ] = "auto",
) -> Published:
    """Register the base as round 0 of the campaign (parent 'none') and evaluate it once."""
    tracker = Tracker.connect(settings(), StorageRoot.of(ctx.storage))
    model_version = None
    if publish.register_base:
        # round 0's context names no parent ('none') and the base trained on no trajectories
        tags = lineage_tags(ctx, trajectory_version="none", line=publish.line or "")
        name = publish.registered_name
        version = tracker.register(name, ctx.parent_checkpoint, ctx.mlflow_run_id, tags)
        model_version = f"{name}/{version}"
    evaluation = run_evaluate(
        ctx=ctx,
        config=evaluate.model_copy(update={"approval": "none"}),  # the starting point: nothing to decide
        prompts=prompts,
        verify=verify,
        environment=environment,
        episode=episode,
        checkpoint=ctx.parent_checkpoint,
        model_version=model_version,
        engines=engines,
        device=device,
    )
    metrics = evaluation.metrics()
    tracker.log(ctx.mlflow_run_id, metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=0)
    tracker.finish(ctx.mlflow_run_id)
    return Published(model_version=model_version or "none", stats=metrics, accuracy=evaluation.accuracy)
