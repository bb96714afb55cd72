"""The starting policy of a campaign: a built-in one (built once, cached under the storage root) or
any Hugging Face causal-LM directory, checked before the campaign does anything else."""

from __future__ import annotations

import hashlib
import os
import tempfile

BUILTIN = "builtin"  # the addition base; every built-in base is listed in models.builtin.BUILTINS


def run_prepare_base(storage: str, base_model: str, progress=None) -> dict:
    """Returns the base checkpoint URI and its identity (recorded as every checkpoint's base_model tag)."""
    from models.base_policy import build_base_policy
    from models.builtin import BUILTINS
    from models.policy import check_policy_dir
    from storage import checkpoints
    from storage.paths import StorageRoot

    root = StorageRoot.of(storage)
    if base_model not in BUILTINS:
        check_policy_dir(base_model)
        with open(os.path.join(base_model, "config.json"), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:12]
        return {"checkpoint": os.path.abspath(base_model), "base_model": f"{os.path.abspath(base_model)}@{digest}", "built": False}
    builtin = BUILTINS[base_model]
    name = builtin.cache_name
    target = root.base_policy(name)
    if not checkpoints.is_committed(root, target):
        with tempfile.TemporaryDirectory(prefix="rlrounds-base-") as tmp:
            if progress is None:
                from tasks.report import report_progress as progress
            meta = build_base_policy(tmp, progress=progress, task=builtin)
            checkpoints.commit_checkpoint(root, tmp, target, {"kind": "base", **meta})
        built = True
    else:
        built = False
    return {"checkpoint": target, "base_model": name, "built": built}


from prefect import task  # noqa: E402 -- the thin Prefect wrapper stays at the bottom
from prefect.cache_policies import NO_CACHE  # noqa: E402

prepare_base_task = task(name="prepare-base", cache_policy=NO_CACHE)(run_prepare_base)


def run_register_base(ctx, publish_config, evaluate_config, prompts_config, verifier_name: str) -> dict:
    """Register the base as round 0 of the campaign (parent 'none') and evaluate it once."""
    from storage.lineage import Tracker
    from storage.paths import StorageRoot
    from storage.settings import settings
    from tasks.evaluate import run_evaluate
    from tasks.publish import lineage_tags

    tracker = Tracker.connect(settings(), StorageRoot.of(ctx.storage))
    model_version = None
    if publish_config.register_base:
        tags = lineage_tags(round_index=0, run_id=ctx.run_id, parent_model_version="none", trajectory_version="none",
                            base_model=ctx.base_model, config_hash=ctx.config_hash, code_version=ctx.code_version,
                            prefect_flow_run_id=ctx.flow_run_id)
        version = tracker.register(publish_config.model_name, ctx.parent_checkpoint, ctx.mlflow_run_id, tags)
        model_version = f"{publish_config.model_name}/{version}"
    evaluation = run_evaluate(ctx, evaluate_config, prompts_config, verifier_name, ctx.parent_checkpoint, model_version)
    tracker.log(ctx.mlflow_run_id, metrics={k: v for k, v in evaluation.items() if isinstance(v, (int, float))}, step=0)
    tracker.finish(ctx.mlflow_run_id)
    return {"model_version": model_version or "none", "stats": evaluation}


register_base_task = task(name="register-base", cache_policy=NO_CACHE)(run_register_base)
