"""Training: GRPO-style policy-gradient steps over the kept samples of one trajectory version.

The round's trainable groups are split into ``steps_per_round`` minibatches of ``groups_per_step``
groups, in a seeded shuffle of their ids (``minibatch_order``), one optimizer step each. Later
minibatches are a few steps stale relative to the weights that sampled them; the PPO ratio and its
clip account for that, and the staleness is logged. Optimizer state travels with the checkpoint so the
next round (or a replay) continues exactly.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import pyarrow.compute as pc
import torch

from models.checkpoint import load_policy, save_policy
from models.logprobs import completion_logprobs, pack_shared, right_padded
from models.loss import LossInputs, LossSettings, logprob_mismatch, policy_loss, pooled_mismatch
from storage import checkpoints
from storage.paths import StorageRoot
from storage.trajectories import read_manifest, read_table
from tasks.config.train import TrainConfig
from tasks.context import RoundContext
from tasks.report import report_progress
from tasks.results import NotInput, Trained

OPTIMIZER_FILE = "optimizer.pt"


def loss_settings(config: TrainConfig) -> LossSettings:
    return LossSettings(config.clip_low, config.clip_high, config.tis_cap, config.aggregation, config.kl_coef)


@dataclass
class TrainBatch:
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    behaviour: list[list[float]]
    advantages: list[float]
    policy_versions: list[list[int]]
    top_p: list[float]  # per sample: the nucleus its behaviour logprobs were renormalised over
    max_tokens: int | None = None  # the sampling limit on completion tokens (dr_grpo's denominator)


def minibatches(
    rows: list[dict], groups_per_step: int, steps: int, shuffle_seed: int | None = None
) -> list[TrainBatch]:
    """Kept rows (in stored order) -> up to ``steps`` minibatches of whole groups: in stored order, or
    with ``shuffle_seed`` in the order of a hash of (seed, group id), which depends on nothing but the
    rows and the seed (``TrainConfig.minibatch_order``)."""
    order: list[str] = []
    by_group: dict[str, list[dict]] = {}
    for row in rows:
        if row["group_id"] not in by_group:
            order.append(row["group_id"])
            by_group[row["group_id"]] = []
        by_group[row["group_id"]].append(row)
    if shuffle_seed is not None:
        order.sort(key=lambda group_id: _group_key(shuffle_seed, group_id))
    out = []
    for step in range(steps):
        chosen = [r for g in order[step * groups_per_step : (step + 1) * groups_per_step] for r in by_group[g]]
        if not chosen:
            break
        out.append(
            TrainBatch(
                [r["prompt_token_ids"] for r in chosen],
                [r["completion_token_ids"] for r in chosen],
                [r["rollout_logprobs"] for r in chosen],
                [r["advantage"] for r in chosen],
                [r["token_policy_versions"] for r in chosen],
                [float((r.get("sampling") or {}).get("top_p") or 1.0) for r in chosen],
                max(((r.get("sampling") or {}).get("max_tokens") or 0 for r in chosen), default=0) or None,
            )
        )
    return out


def _group_key(seed: int, group_id: str) -> bytes:
    return hashlib.blake2b(f"{seed}/{group_id}".encode(), digest_size=8).digest()


def train_policy(
    model,
    pad_token_id: int,
    batches: list[TrainBatch],
    config: TrainConfig,
    temperature: float,
    optimizer_state: dict | None,
    current_version: int,
    recompute: bool | list[bool],
    ref_model=None,
    progress=None,
):
    """Run the optimizer steps; returns (optimizer state dict, stats)."""
    torch.manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
        for group in optimizer.param_groups:  # a new round may change the schedule
            group["lr"], group["weight_decay"] = config.learning_rate, config.weight_decay
    # each group's prompt is encoded once and shared by its samples: about half the tokens of
    # scoring every sample's full sequence (models/checkpoint.py, completion_logprobs)
    packed = [pack_shared(b.prompt_ids, b.completion_ids, pad_token_id) for b in batches]
    top_ps = [torch.tensor(b.top_p, dtype=torch.float32) for b in batches]  # [B] each
    plan = recompute if isinstance(recompute, list) else [recompute] * len(batches)
    with torch.no_grad():  # trainer logprobs at the sampling weights, before any step moves them
        proximal = [
            completion_logprobs(model, p, temperature, nucleus) if wanted else None
            for p, nucleus, wanted in zip(packed, top_ps, plan)
        ]
    settings = loss_settings(config)
    history: dict[str, list[float]] = {
        k: [] for k in ("loss", "clip_fraction", "grad_norm", "tis_mean", "tis_truncated_fraction", "kl", "ratio_mean")
    }
    lag_sum, lag_count, lag_max = 0.0, 0, 0.0
    drift, stopped = 0.0, False
    freshness: list[torch.Tensor] = []  # per minibatch: [N, 2] (version lag, log behaviour weight) of its tokens
    mismatch: list[dict[str, float]] = []  # engine vs trainer, at the sampling weights
    drifted: list[dict[str, float]] = []  # trainer before each first-pass update vs the sampling weights
    # Forward passes stay in eval mode: dropout would make the trainer score another (random) policy
    # than the engine sampled from, so the ratio would not be 1 at step 0, the mismatch figure would
    # measure dropout noise, and the loss would depend on the RNG rather than on the stored rows.
    model.eval()
    schedule = [index for _ in range(config.epochs) for index in range(len(batches))]
    for step, index in enumerate(schedule):
        batch, tokens = batches[index], packed[index]
        width = tokens.completion_ids.shape[1]
        mask = tokens.completion_mask.float()  # [B, C]
        behaviour = right_padded(batch.behaviour, width)  # [B, C]
        logp = completion_logprobs(model, tokens, temperature, top_ps[index])  # [B, C]
        sampling = behaviour if proximal[index] is None else proximal[index]  # the weights the rows came from
        drift = policy_drift(logp.detach(), sampling, mask)
        if config.max_kl is not None and step > 0 and drift > config.max_kl:
            stopped = True  # every round makes at least one update
            break
        ref = None
        if ref_model is not None and config.kl_coef > 0:
            with torch.no_grad():
                ref = completion_logprobs(ref_model, tokens, temperature, top_ps[index])
        # Engine vs trainer at the weights that sampled: every minibatch's proximal logprobs where they
        # were recomputed, else the first minibatch before any update (the others are scored k updates
        # past those weights). The round's own drift, trainer now against the sampling weights, is kept
        # apart, so neither figure hides in the other. Only tokens sampled by the parent policy count: a
        # carried-over token's gap is staleness, not mismatch. Later passes repeat the first's minibatches.
        versions = right_padded(batch.policy_versions, width, fill=-1)  # [B, C]
        current = (versions == current_version).float()  # [B, C]
        if step < len(batches):
            if proximal[index] is not None or step == 0:
                at_sampling = logp.detach() if proximal[index] is None else proximal[index]
                mismatch.append(logprob_mismatch(at_sampling, behaviour, mask * current))
            drifted.append(logprob_mismatch(logp.detach(), sampling, mask * current))
        on = mask.bool()
        freshness.append(torch.stack([(current_version - versions)[on], (logp.detach() - behaviour)[on]], dim=-1))
        inputs = LossInputs(
            logp,
            behaviour,
            torch.tensor(batch.advantages, dtype=torch.float32),
            mask,
            proximal[index],
            ref,
            batch.max_tokens,
        )
        out = policy_loss(inputs, settings)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        for key, value in (
            ("loss", float(out.loss.detach())),
            ("clip_fraction", out.clip_fraction),
            ("grad_norm", float(grad_norm)),
            ("tis_mean", out.tis_mean),
            ("tis_truncated_fraction", out.tis_truncated_fraction),
            ("kl", out.kl),
            ("ratio_mean", out.ratio_mean),
        ):
            history[key].append(value)
        # Staleness in optimizer steps: the weights being trained are `step` steps past the round's
        # starting policy, plus a whole round per policy version the token lags behind it.
        lag = step + (current_version - versions[on]) * len(schedule)  # [N] over the minibatch's tokens
        lag_sum, lag_count = lag_sum + float(lag.sum()), lag_count + lag.numel()
        lag_max = max(lag_max, float(lag.max()) if lag.numel() else 0.0)
        if progress and (step + 1) % 8 == 0:
            progress(f"train: step {step + 1}/{len(schedule)} loss {out.loss.item():.4f}")
    stats = {f"train/{k}": statistics.fmean(v) for k, v in history.items() if v}
    pooled, drift_pooled = pooled_mismatch(mismatch), pooled_mismatch(drifted)
    stats.update(
        {
            "train/steps": len(history["loss"]),
            # the rows trained on, once each, whatever the passes
            "train/samples": sum(len(batches[i].advantages) for i in set(schedule[: len(history["loss"])])),
            "train/drift_kl": drift,
            "train/stopped_at_kl": float(stopped),
            "train/mismatch_mean_abs": pooled["mean_abs"],
            "train/mismatch_max_abs": pooled["max_abs"],
            "train/mismatch_kl": pooled["kl"],
            "train/mismatch_tokens": pooled["tokens"],
            "train/drift_mean_abs": drift_pooled["mean_abs"],
            "train/drift_max_abs": drift_pooled["max_abs"],
            "train/staleness_mean_steps": lag_sum / lag_count if lag_count else 0.0,
            "train/staleness_max_steps": lag_max,
            "train/recomputed_proximal": statistics.fmean(plan) if plan else 0.0,
            "train/samples_spanning_versions_share": statistics.fmean(
                len(set(v)) > 1 for b in batches for v in b.policy_versions
            )
            if batches
            else 0.0,
            **freshness_stats(torch.cat(freshness) if freshness else torch.zeros((0, 2)), config.tis_cap),
        }
    )
    return optimizer.state_dict(), stats


def policy_drift(current, sampling, mask) -> float:
    """How far the weights being trained have moved from the sampling policy over one minibatch: the k3
    estimate of KL(sampling || current), mean over its tokens. current, sampling, mask: [B, C]."""
    with torch.no_grad():
        log_ratio = (current - sampling) * mask
        return float(((log_ratio.exp() - 1 - log_ratio) * mask).sum() / mask.sum().clamp(min=1.0))


def freshness_stats(tokens, tis_cap: float) -> dict[str, float]:
    """How stale and how far off-policy the trained tokens were. ``tokens``: [N, 2], per trained token its
    version lag (the trained policy's version minus the version that sampled it) and log(pi / mu), the
    trainer's logprob at the step that used it minus the behaviour logprob.

    The divergence figures compare the behaviour policy with the weights each token was trained at, so
    they hold numerics, carried-over versions and the round's own drift (minibatch k is k steps past
    the sampling weights); the k3 estimate is of KL(mu || pi) over tokens sampled from mu."""
    if tokens.shape[0] == 0:
        return {}
    lag, log_w = tokens[:, 0].double(), tokens[:, 1].double()  # [N], [N]
    weight = log_w.exp()
    return {
        "train/lag_versions_mean": float(lag.mean()),
        "train/lag_versions_p50": float(torch.quantile(lag, 0.5)),
        "train/lag_versions_p99": float(torch.quantile(lag, 0.99)),
        "train/lag_versions_max": float(lag.max()),
        "train/behaviour_kl_k3": float((weight - 1 - log_w).mean()),
        "train/behaviour_weight_mean": float(weight.mean()),
        "train/behaviour_weight_p99": float(torch.quantile(weight, 0.99)),
        "train/behaviour_weight_over_cap": float((weight > tis_cap).double().mean()),
    }


def save_optimizer(state: dict, directory: str) -> None:
    torch.save(state, os.path.join(directory, OPTIMIZER_FILE))


def load_optimizer(directory: str) -> dict | None:
    path = os.path.join(directory, OPTIMIZER_FILE)
    return torch.load(path, weights_only=True) if os.path.exists(path) else None


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
]


def needs_proximal(
    setting: str, rollout_dtype: str, engines: list[dict], top_ps: list[float] = (), stale_tokens: bool = False
) -> bool:
    """Whether to recompute the trainer's logprobs at the sampling weights (enables truncated IS).

    'auto' skips it only when every sample came from the embedded engine at float32 without a nucleus
    (top_p 1), whose logprobs match the trainer's to ~1e-6, and every token was sampled by the parent
    policy. Any other engine (vLLM: other kernels, batching) or precision needs it; so does top_p < 1
    (a 1e-6 difference in logits can move a token across the nucleus boundary, which changes the
    renormaliser by that token's whole mass); and so do tokens of an older policy version (carried-over
    partial rollouts): the PPO ratio is then taken against the parent policy and the truncated
    importance weight corrects for the older behaviour policy.
    """
    if setting != "auto":
        return setting == "always"
    if stale_tokens or rollout_dtype != "float32" or any(p < 1.0 for p in top_ps):
        return True
    return any(
        (e or {}).get("name", "embedded") != "embedded" or (e or {}).get("dtype", "float32") != "float32"
        for e in engines
    )


def proximal_plan(
    setting: str, rollout_dtype: str, engines: list[dict], batches: list[TrainBatch], current_version: int
) -> list[bool]:
    """Per minibatch, whether to recompute its proximal logprobs (``needs_proximal``'s rule, minibatch by
    minibatch). The engine and precision are the round's, so they decide for every minibatch; a nucleus
    or an older policy's tokens decide only for the minibatches holding them, and the pass then scores
    the whole minibatch: scoring only its rows that need it would be cheaper, but a forward pass over
    another set of rows rounds differently with another thread count, and a replay in a process of
    another thread count would then not reproduce the round's weights bit for bit."""
    if setting != "auto" or needs_proximal(setting, rollout_dtype, engines):
        return [needs_proximal(setting, rollout_dtype, engines)] * len(batches)
    return [
        needs_proximal(
            setting,
            rollout_dtype,
            [],
            batch.top_p,
            stale_tokens=any(v != current_version for versions in batch.policy_versions for v in versions),
        )
        for batch in batches
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
    progress: Annotated[Callable[[str], None] | None, NotInput("a progress callback")] = None,
) -> Trained:
    """Train from the parent checkpoint on a committed trajectory version; commit the new checkpoint.

    ``temperature`` and ``rollout_dtype``: what the behaviour logprobs were recorded under (the loss
    recomputes logprobs at that temperature; the dtype decides whether the proximal pass is needed)."""
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
    model, tokenizer = load_policy(parent, dtype="float32")
    base = checkpoints.base_checkpoint(root, ctx.parent_checkpoint)
    ref_model = None
    if config.kl_coef > 0:
        reference = parent if config.kl_reference == "parent" else checkpoints.local_copy(root, base)
        ref_model = load_policy(reference, dtype="float32")[0]
    shuffle_seed = config.seed if config.minibatch_order == "shuffled" else None
    batches = minibatches(rows, config.groups_per_step, config.steps_per_round, shuffle_seed)
    recompute = proximal_plan(
        config.recompute_proximal, rollout_dtype, [r["engine"] for r in rows], batches, ctx.parent_policy_version
    )
    if progress is None:
        progress = report_progress
    started_at = time.time()  # the round's straggler wait ends here (tasks/report.py)
    state, stats = train_policy(
        model,
        tokenizer.pad_token_id,
        batches,
        config,
        temperature,
        load_optimizer(parent),
        ctx.parent_policy_version,
        recompute,
        ref_model,
        progress,
    )
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
        **(lineage_extra or {}),
    }
    with tempfile.TemporaryDirectory(prefix="rlrounds-ckpt-") as tmp:
        save_policy(model, tokenizer, tmp)
        save_optimizer(state, tmp)
        checkpoints.commit_checkpoint(root, tmp, target, lineage)
    stats["train/started_at"] = started_at
    return Trained(checkpoint=target, stats=stats, committed_at=time.time())
