"""The train stage: a round's kept samples, trained from the parent checkpoint into a committed one.

The update itself (minibatches, the PPO-style steps, the figures they log) is tasks/train/policy_update.py. This
stage reads the round's kept rows, trains them in this process (``train.workers`` 1) or on a worker
group (tasks/train/worker_group.py), and commits the new checkpoint with the optimizer state, so the next
round (or a replay) continues exactly.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Annotated

import pyarrow.compute as pc
import torch

from models.checkpoint import load_policy, save_policy
from models.device import deterministic_kernels, resolve_device, resolve_precision
from models.memory import ADAPTER_DIR, add_adapters, merged_policy, save_adapters
from models.sharded import load_optimizer, on_cpu, save_optimizer
from storage import checkpoints
from storage.paths import StorageRoot
from storage.trajectories import read_manifest, read_table
from tasks.config.base import NotInput
from tasks.config.train import TrainConfig
from tasks.round.context import RoundContext
from tasks.round.report import report_progress
from tasks.round.results import Trained
from tasks.serving.live import LiveEngines
from tasks.train.policy_update import TrainBatch, minibatches, proximal_plan, sharded_minibatches, train_policy
from tasks.train.worker_group import TrainerWorkers, TrainJob, write_files

# -- the stage ------------------------------------------------------------------------------------

TRAIN_COLUMNS = [
    "group_id",
    "kept",
    "prompt_token_ids",
    "completion_token_ids",
    "rollout_logprobs",
    "advantage",
    "token_policy_versions",
    "engine",
    "sampling",
    "turns",
]


def kept_rows(table) -> list[dict]:
    return table.filter(pc.field("kept")).select(TRAIN_COLUMNS).to_pylist()


def run_train(
    *,
    ctx: RoundContext,
    trajectory_uri: str,
    config: TrainConfig,
    temperature: float,
    rollout_dtype: str,
    lineage_extra: dict | None = None,
    target_checkpoint: str | None = None,
    engines: Annotated[LiveEngines, NotInput("the live engines a GPU trainer offers its new weights to")],
    trainers: Annotated[TrainerWorkers, NotInput("the worker group of the flow that runs the round")],
    device: Annotated[str, NotInput("where it computes: a round resumed on another machine trains the same")] = "auto",
    ray_address: Annotated[str | None, NotInput("the cluster a worker group runs on")] = None,
    progress: Annotated[Callable[[str], None] | None, NotInput("a progress callback")] = None,
) -> Trained:
    """Train from the parent checkpoint on a committed trajectory version; commit the new checkpoint.

    ``temperature`` and ``rollout_dtype``: what the behaviour logprobs were recorded under (the loss
    recomputes logprobs at that temperature; the dtype decides whether the proximal pass is needed).
    ``device``: the round's device setting; ``config.workers`` > 1 trains on ``trainers``' worker group
    (tasks/train/worker_group.py) on ``ray_address``'s cluster. A GPU trainer offers the new weights to ``engines``
    in memory, for publish to load without reading the checkpoint."""
    root = StorageRoot.of(ctx.storage)
    target = target_checkpoint or root.checkpoint(ctx.run_id, ctx.round)
    if checkpoints.is_committed(root, target):  # resumed after the commit: never train twice
        return Trained(checkpoint=target, stats={}, committed_at=None, resumed=True)
    manifest = read_manifest(root, trajectory_uri)
    rows = kept_rows(read_table(root, manifest, columns=TRAIN_COLUMNS))
    if not rows:
        raise RuntimeError(
            f"trajectory version {manifest.version} has no kept samples; nothing to train on "
            "(check filter statistics: all groups zero-variance or failed?)"
        )
    parent = checkpoints.local_copy(root, ctx.parent_checkpoint)
    base = checkpoints.base_checkpoint(root, ctx.parent_checkpoint)
    reference = None
    if config.kl_coef > 0:
        reference = parent if config.kl_reference == "parent" else checkpoints.local_copy(root, base)
    shuffle_seed = None if config.minibatch_order == "stored" else config.seed
    # carried-over groups together: only the minibatches holding them need the proximal pass (proximal_plan)
    carried_before = ctx.parent_policy_version if config.minibatch_order == "carried_first" else None
    batches = minibatches(
        rows, config.groups_per_step, config.steps_per_round, shuffle_seed, carried_before, config.credit
    )
    recompute = proximal_plan(
        config.recompute_proximal, rollout_dtype, [r["engine"] for r in rows], batches, ctx.parent_policy_version
    )
    if progress is None:
        progress = report_progress
    started_at = time.time()  # the round's straggler wait ends here (tasks/round/report.py)
    with tempfile.TemporaryDirectory(prefix="rlrounds-ckpt-") as tmp:
        if config.workers == 1:
            placed = resolve_device(device)
            precision = resolve_precision(config.precision, placed)
            stats, weights = train_here(
                parent,
                reference,
                batches,
                config=config,
                temperature=temperature,
                current_version=ctx.parent_policy_version,
                recompute=recompute,
                out=tmp,
                device=placed,
                precision=precision,
                progress=progress,
            )
        else:
            weights = None  # a group's weights reach the engine through the checkpoint
            group = trainers.group(config.workers, device, ray_address)
            progress(f"train: {config.workers} workers ({'GPU' if group.on_gpu else 'CPU'}), {len(batches)} steps")
            shares = sharded_minibatches(
                rows,
                config.groups_per_step,
                config.steps_per_round,
                shuffle_seed,
                config.workers,
                carried_before,
                config.credit,
            )
            job = TrainJob(
                shares=[],
                config=config,
                temperature=temperature,
                current_version=ctx.parent_policy_version,
                recompute=recompute,
            )
            files, stats, memory = group.train(parent, job, shares, reference)
            write_files(tmp, files)
            placed = torch.device("cuda" if group.on_gpu else "cpu")
            precision = resolve_precision(config.precision, placed)
            stats["train/worker_resident_bytes_max"] = max(sum(m.values()) for m in memory)
        lineage = {
            "kind": "round",
            "run_id": ctx.run_id,
            "round": ctx.round,
            "policy_version": ctx.round,
            "parent_checkpoint": ctx.parent_checkpoint,
            "base_checkpoint": base,
            "parent_model_version": ctx.parent_model_version,
            "trajectory_version": manifest.version,
            "trajectory_uri": manifest.directory,
            "base_model": ctx.base_model,
            "config_hash": ctx.config_hash,
            "code_version": ctx.code_version,
            "train_config": config.model_dump(mode="json"),
            "trained_on": {"workers": config.workers, "device": placed.type, "precision": precision},
            **lora_lineage(config, ctx.parent_checkpoint),
            **(lineage_extra or {}),
        }
        checkpoints.commit_checkpoint(root, tmp, target, lineage)
    if weights is not None:
        engines.offer_weights(target, weights)
    stats["train/workers"] = config.workers
    stats["train/started_at"] = started_at
    return Trained(checkpoint=target, stats=stats, committed_at=time.time())


def train_here(
    parent: str,
    reference: str | None,
    batches: list[TrainBatch],
    *,
    config: TrainConfig,
    temperature: float,
    current_version: int,
    recompute: list[bool],
    out: str,
    device: torch.device,
    precision: str,
    progress: Callable[[str], None],
) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """A round's training in this process, on ``device``; the new checkpoint is written into ``out``.
    Returns the stats, and on a GPU the new weights on it."""
    deterministic_kernels()
    model, tokenizer = load_policy(parent, dtype="float32", device=device)
    ref_model = load_policy(reference, dtype="float32", device=device)[0] if reference else None
    adapted = None
    if config.lora is not None:  # fresh adapters each round: the parent's optimizer state is not theirs
        lora = config.lora
        adapted = add_adapters(
            model, rank=lora.rank, alpha=lora.alpha, target_modules=lora.target_modules, seed=config.seed
        )
        model = adapted.get_base_model()  # the same modules, adapters injected
    optimizer, stats = train_policy(
        model,
        tokenizer.pad_token_id,
        batches,
        config=config,
        temperature=temperature,
        optimizer=None if adapted is not None else load_optimizer(parent, model),
        current_version=current_version,
        recompute=recompute,
        ref_model=ref_model,
        progress=progress,
        device=device,
        precision=precision,
    )
    if adapted is not None:  # the adapters and their Adam state apart, for audit; the policy merged
        save_adapters(adapted, os.path.join(out, ADAPTER_DIR))
        save_optimizer(on_cpu(optimizer.state_dict()), os.path.join(out, ADAPTER_DIR))
        model = merged_policy(adapted)
    save_policy(model, tokenizer, out)  # from CPU tensors, wherever the model is: it loads on any device
    # the new weights where they were trained, for a GPU serving engine to take from memory (publish)
    weights = {k: v.detach() for k, v in model.state_dict().items()} if device.type == "cuda" else None
    if adapted is None:
        save_optimizer(on_cpu(optimizer.state_dict()), out)
    return stats, weights


def lora_lineage(config: TrainConfig, parent: str) -> dict:
    """What lineage.json records of a LoRA round: the adapters' settings, the weights they were trained on
    (the parent checkpoint) and where they are kept beside the merged policy."""
    if config.lora is None:
        return {}
    return {"lora": {**config.lora.model_dump(mode="json"), "adapter_base": parent, "adapter_dir": ADAPTER_DIR}}
