"""A round's policy update: GRPO-style policy-gradient steps over the kept samples of one trajectory version.

The round's trainable groups are split into ``steps_per_round`` minibatches of ``groups_per_step``
groups, in a seeded shuffle of their ids (``minibatch_order``), one optimizer step each. Later
minibatches are a few steps stale relative to the weights that sampled them; the PPO ratio and its
clip account for that, and the staleness is logged. ``train_policy`` runs the steps in one process, or
as one worker's share of each minibatch in a group (``Collective``; tasks/train/worker_group.py). How rows
become minibatches, shares and micro-batches is tasks/train/minibatches.py (re-exported here).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from dataclasses import dataclass

import torch

from models.device import autocast
from models.logprobs import (
    COMPLETION_PADDING_BUDGET,
    SharedPromptBatch,
    completion_logprobs,
    pack_shared,
    right_padded,
    sequence_logprobs,
)
from models.loss import LossInputs, LossSettings, logprob_mismatch, policy_loss, pooled_mismatch
from models.memory import checkpoint_layers, checkpointed, trainable_parameters
from tasks.config.train import TrainConfig
from tasks.train.minibatches import TrainBatch as TrainBatch
from tasks.train.minibatches import carried_over
from tasks.train.minibatches import microbatches as microbatches
from tasks.train.minibatches import minibatches as minibatches
from tasks.train.minibatches import sharded_minibatches as sharded_minibatches

CPU = torch.device("cpu")


def loss_settings(config: TrainConfig) -> LossSettings:
    return LossSettings(config.clip_low, config.clip_high, config.tis_cap, config.aggregation, config.kl_coef)


class Collective:
    """How one trainer's share of a step's figures becomes the step's. In one process the share is the
    whole and every figure passes through untouched; a worker of a group (tasks/train/worker_group.py) sums,
    maxes and gathers across the group."""

    world, rank = 1, 0

    def sum(self, values: list[float]) -> list[float]:
        return values

    def max(self, values: list[float]) -> list[float]:
        return values

    def gather(self, value: object) -> list:
        return [value]


ONE_PROCESS = Collective()


def adamw(model, config: TrainConfig, state: dict | None = None) -> torch.optim.AdamW:
    """The round's optimizer, continuing ``state`` (a plain ``state_dict``) when given."""
    optimizer = torch.optim.AdamW(
        trainable_parameters(model), lr=config.learning_rate, weight_decay=config.weight_decay
    )  # every parameter in full fine-tuning; only the adapters under LoRA
    if state is not None:
        optimizer.load_state_dict(state)
    return schedule(optimizer, config)


def steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """Steps the optimizer has taken, over every round its state has carried through (AdamW counts them)."""
    return next((int(state["step"]) for state in optimizer.state.values() if "step" in state), 0)


SCALE_KEY = "rlrounds_lr_scale"  # in each parameter group: saved with the optimizer's state, so it carries
SCALE_STEP, SCALE_BOUNDS = 1.5, (1 / 8, 8.0)


def rate_scale(optimizer: torch.optim.Optimizer) -> float:
    """The learning-rate scale ``train.drift_target`` has reached in the rounds this optimizer's state carried
    through (1.0 for a fresh one)."""
    return float(optimizer.param_groups[0].get(SCALE_KEY, 1.0))


def rescale(optimizer: torch.optim.Optimizer, config: TrainConfig, drift: float, stopped: bool) -> float:
    """After a round: move the scale toward ending the next round at ``drift_target`` (a round's drift grows
    about as the square of its rate): down a step after a round stopped at ``max_kl`` or drifted past twice the
    target, up a step after one that ended below half of it. Returns the scale the next round starts at."""
    scale = rate_scale(optimizer)
    if config.drift_target is not None:
        if stopped or drift > 2 * config.drift_target:
            scale /= SCALE_STEP
        elif drift < config.drift_target / 2:
            scale *= SCALE_STEP
        scale = min(max(scale, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])
        for group in optimizer.param_groups:
            group[SCALE_KEY] = scale
    return scale


def step_rate(optimizer: torch.optim.Optimizer, config: TrainConfig) -> float:
    """Set the next step's learning rate: ``learning_rate`` under ``train.drift_target``'s scale and
    ``train.warmup_steps``' linear ramp; returns it."""
    rate = config.learning_rate * (rate_scale(optimizer) if config.drift_target is not None else 1.0)
    if config.warmup_steps:
        rate *= min(1.0, (steps_taken(optimizer) + 1) / config.warmup_steps)
    for group in optimizer.param_groups:
        group["lr"] = rate
    return rate


def schedule(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.Optimizer:
    for group in optimizer.param_groups:  # a new round may change the schedule (a loaded state brings its own)
        group["lr"], group["weight_decay"] = config.learning_rate, config.weight_decay
        group["betas"] = (group["betas"][0], config.adam_beta2)
    return optimizer


def train_policy(
    model,
    pad_token_id: int,
    batches: list[TrainBatch],
    *,
    config: TrainConfig,
    temperature: float,
    optimizer: torch.optim.Optimizer | dict | None,
    current_version: int,
    recompute: bool | list[bool],
    ref_model=None,
    progress=None,
    device: torch.device = CPU,
    precision: str = "fp32",
    collective: Collective = ONE_PROCESS,
):
    """Run the optimizer steps; returns (optimizer, stats).

    ``optimizer``: one built over ``model`` (``adamw``), or the plain state to continue (None: fresh).
    ``model`` and its optimizer live on ``device``; forward passes run under ``precision``'s autocast.
    With a ``collective``, ``batches`` are this worker's shares of the step's minibatches (each naming
    its whole minibatch's ``step`` totals) and every figure returned is the whole step's."""
    torch.manual_seed(config.seed)
    started = time.perf_counter()
    if not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = adamw(model, config, optimizer)
    # each group's prompt is encoded once and shared by its samples: about half the tokens of
    # scoring every sample's full sequence (models/logprobs.py, completion_logprobs)
    parts = [[Part.of(b, pad_token_id, device) for b in microbatches(batch, config)] for batch in batches]
    if collective.world > 1 and config.max_tokens_per_microbatch is not None:
        parts = even_parts(parts, collective)
    plan = recompute if isinstance(recompute, list) else [recompute] * len(batches)
    forward = functools.partial(autocast, device, precision)
    model.eval()  # why eval mode: see the loop below
    if config.gradient_checkpointing:
        checkpoint_layers(model)
    # a sharded model gathers its weights at every call, so each worker must call it as often as the others:
    # one completion chunk whatever its rows' lengths. Checkpointed layers keep no KV cache: whole sequences.
    score = (
        sequence_logprobs
        if checkpointed(model)
        else functools.partial(
            completion_logprobs, padding_budget=None if collective.world > 1 else COMPLETION_PADDING_BUDGET
        )
    )
    with torch.no_grad(), forward():  # trainer logprobs at the sampling weights, before any step moves them
        for minibatch, wanted in zip(parts, plan):
            for part in minibatch if wanted else []:
                part.proximal = score(model, part.tokens, temperature, part.top_p)
    settings = loss_settings(config)
    per_step = ("loss", "clip_fraction", "grad_norm", "tis_mean", "tis_truncated_fraction", "kl", "ratio_mean")
    history: dict[str, list[float]] = {k: [] for k in (*per_step, "learning_rate")}
    lag_sum, lag_count, lag_max = 0.0, 0, 0.0
    drift, stopped = 0.0, False
    freshness: list[torch.Tensor] = []  # per minibatch: [N, 2] (version lag, log behaviour weight) of its tokens
    mismatch: list[dict[str, float]] = []  # engine vs trainer, at the sampling weights
    drifted: list[dict[str, float]] = []  # trainer before each first-pass update vs the sampling weights
    # Forward passes stay in eval mode: dropout would make the trainer score another (random) policy
    # than the engine sampled from, so the ratio would not be 1 at step 0, the mismatch figure would
    # measure dropout noise, and the loss would depend on the RNG rather than on the stored rows.
    passes = [index for _ in range(config.epochs) for index in range(len(batches))]
    for step, index in enumerate(passes):
        optimizer.zero_grad(set_to_none=True)
        # each micro-batch is scored and back-propagated before the next is scored, its gradient accumulated:
        # only one micro-batch's activations are alive at a time. The drift check needs every micro-batch's
        # logprobs, so it comes after them; a step it stops makes no update (its gradients are dropped).
        done = [
            part_step(model, part, step=step, first_pass=step < len(batches), current_version=current_version,
                      score=score, forward=forward, temperature=temperature, settings=settings, config=config,
                      ref_model=ref_model, collective=collective)
            for part in parts[index]
        ]  # fmt: skip
        drift = step_drift(done, collective)
        if config.max_kl is not None and step > 0 and drift > config.max_kl:
            stopped = True  # every round makes at least one update
            optimizer.zero_grad(set_to_none=True)
            break
        for part in done:
            mismatch.extend(part.mismatch)
            drifted.extend(part.drifted)
            freshness.append(part.freshness)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        rate = step_rate(optimizer, config)
        optimizer.step()
        loss, figures, tokens = step_loss_figures(done)
        loss, figures = step_figures(loss, figures, tokens, collective)
        for key, value in zip(history, [loss, figures[0], float(full_tensor(grad_norm)), *figures[1:], rate]):
            history[key].append(value)
        # Staleness in optimizer steps: the weights being trained are `step` steps past the round's
        # starting policy, plus a whole round per policy version the token lags behind it.
        for part in done:
            lag = step + (current_version - part.versions) * len(passes)  # [N] over the part's tokens
            lag_sum, lag_count = lag_sum + float(lag.sum()), lag_count + lag.numel()
            lag_max = max(lag_max, float(lag.max()) if lag.numel() else 0.0)
        if progress and collective.rank == 0 and (step + 1) % 8 == 0:
            progress(f"train: step {step + 1}/{len(passes)} loss {loss:.4f}")
    trained = set(passes[: len(history["loss"])])
    samples = sum(len(batches[i].advantages) for i in trained if not batches[i].idle)
    spanning = [len(set(v)) > 1 for b in batches if not b.idle for v in b.policy_versions]
    lag_sum, lag_count, samples, spanned, shares = collective.sum(
        [lag_sum, lag_count, samples, sum(spanning), len(spanning)]
    )
    (lag_max,) = collective.max([lag_max])
    mismatch, drifted = (sum(collective.gather(parts), []) for parts in (mismatch, drifted))
    freshness = [torch.cat(parts) for parts in collective.gather(freshness) if parts]
    stats = {f"train/{k}": statistics.fmean(v) for k, v in history.items() if v}
    scale = rescale(optimizer, config, drift, stopped)  # the next round's, kept in the optimizer's state
    pooled, drift_pooled = pooled_mismatch(mismatch), pooled_mismatch(drifted)
    stats.update(
        {
            "train/steps": len(history["loss"]),
            "train/update_s": time.perf_counter() - started,  # scoring and optimizer steps, the figures' gathering
            # the rows trained on, once each, whatever the passes
            "train/samples": int(samples),
            "train/drift_kl": drift,
            "train/stopped_at_kl": float(stopped),
            "train/lr_scale_next": scale,
            "train/mismatch_mean_abs": pooled["mean_abs"],
            "train/mismatch_max_abs": pooled["max_abs"],
            "train/mismatch_kl": pooled["kl"],
            "train/mismatch_tokens": pooled["tokens"],
            "train/drift_mean_abs": drift_pooled["mean_abs"],
            "train/drift_max_abs": drift_pooled["max_abs"],
            "train/staleness_mean_steps": lag_sum / lag_count if lag_count else 0.0,
            "train/staleness_max_steps": lag_max,
            "train/recomputed_proximal": statistics.fmean(plan) if plan else 0.0,
            "train/samples_spanning_versions_share": spanned / shares if shares else 0.0,
            **freshness_stats(torch.cat(freshness) if freshness else torch.zeros((0, 2)), config.tis_cap),
        }
    )
    return optimizer, stats


@dataclass
class Part:
    """One micro-batch of a minibatch (the whole minibatch, without ``train.max_tokens_per_microbatch``),
    packed for scoring on the trainer's device."""

    batch: TrainBatch
    tokens: SharedPromptBatch
    top_p: torch.Tensor  # [B] the nucleus each row was sampled under
    proximal: torch.Tensor | None = None  # [B, C] trainer logprobs at the sampling weights, where recomputed

    @classmethod
    def of(cls, batch: TrainBatch, pad_token_id: int, device: torch.device) -> Part:
        tokens = pack_shared(batch.prompt_ids, batch.completion_ids, pad_token_id).to(device)
        return cls(batch, tokens, torch.tensor(batch.top_p, dtype=torch.float32, device=device))


def even_parts(parts: list[list[Part]], collective: Collective) -> list[list[Part]]:
    """Every worker's minibatches in as many micro-batches as the most any worker has, padded with idle
    stand-ins (counting for nothing): a sharded model's every forward and backward is a collective."""
    most = collective.max([float(len(p)) for p in parts])
    idle = [dataclasses.replace(p[-1], batch=dataclasses.replace(p[-1].batch, idle=True)) for p in parts]
    return [p + [stand_in] * (int(n) - len(p)) for p, stand_in, n in zip(parts, idle, most)]


@dataclass
class PartResult:
    """What one micro-batch's forward and backward leave for its step's figures."""

    loss: float
    figures: list[float]  # clip fraction, tis mean, tis truncated fraction, kl, ratio mean: token means
    tokens: float  # completion tokens it trained on
    drift: tuple[torch.Tensor, torch.Tensor]  # the k3 sum of KL(sampling || current) over its tokens, and their count
    versions: torch.Tensor  # [N] policy version of each of its trained tokens
    freshness: torch.Tensor  # [N, 2] version lag and log behaviour weight of each trained token
    mismatch: list[dict[str, float]]
    drifted: list[dict[str, float]]


def part_step(
    model, part: Part, *, step: int, first_pass: bool, current_version: int, score, forward, temperature: float,
    settings: LossSettings, config: TrainConfig, ref_model, collective: Collective,
) -> PartResult:  # fmt: skip
    """Score one micro-batch, take its share of the step's loss and back-propagate it (the gradient adds to
    the step's); return its figures."""
    batch, tokens = part.batch, part.tokens
    width = tokens.completion_ids.shape[1]
    mask = tokens.completion_mask.float()  # [B, C]
    if batch.idle:  # a worker's stand-in rows when the minibatch has none for it (``shard``): they count for nothing
        mask = torch.zeros_like(mask)
    elif batch.policy_mask is not None:  # an episode's observation tokens: scored as context, never in the loss
        mask = mask * right_padded(batch.policy_mask, width).to(mask.device)
    device = mask.device
    behaviour = right_padded(batch.behaviour, width).to(device)  # [B, C]
    with forward():
        logp = score(model, tokens, temperature, part.top_p)  # [B, C]
    sampling = behaviour if part.proximal is None else part.proximal  # the weights the rows came from
    log_ratio = (logp.detach() - sampling) * mask
    drift = (((log_ratio.exp() - 1 - log_ratio) * mask).sum(), mask.sum())
    ref = None
    if ref_model is not None and config.kl_coef > 0:
        budget = None if collective.world > 1 else COMPLETION_PADDING_BUDGET  # a sharded reference: one chunk, as above
        with torch.no_grad(), forward():
            ref = completion_logprobs(ref_model, tokens, temperature, part.top_p, padding_budget=budget)
    # Engine vs trainer at the weights that sampled: every minibatch's proximal logprobs where they
    # were recomputed, else the first minibatch before any update (the others are scored k updates
    # past those weights). The round's own drift, trainer now against the sampling weights, is kept
    # apart, so neither figure hides in the other. Only tokens sampled by the parent policy count: a
    # carried-over token's gap is staleness, not mismatch. Later passes repeat the first's minibatches.
    versions = right_padded(batch.policy_versions, width, fill=-1).to(device)  # [B, C]
    current = (versions == current_version).float()  # [B, C]
    mismatch, drifted = [], []
    if first_pass:
        if part.proximal is not None or step == 0:
            at_sampling = logp.detach() if part.proximal is None else part.proximal
            mismatch.append(logprob_mismatch(at_sampling, behaviour, mask * current))
        drifted.append(logprob_mismatch(logp.detach(), sampling, mask * current))
    on = mask.bool()
    freshness = torch.stack([(current_version - versions)[on], (logp.detach() - behaviour)[on]], dim=-1).cpu()
    if batch.token_advantages is None:  # [B]: every token its sample's
        advantages = torch.tensor(batch.advantages, dtype=torch.float32, device=device)
    else:  # [B, C]: train.credit 'prefix'
        advantages = right_padded(batch.token_advantages, width).to(device)
    inputs = LossInputs(
        logprobs=logp,
        behaviour_logprobs=behaviour,
        advantages=advantages,
        mask=mask,
        proximal_logprobs=part.proximal,
        ref_logprobs=ref,
        max_tokens=batch.max_tokens,
        step=batch.step,
    )
    out = policy_loss(inputs, settings)
    # a group averages its workers' gradients: each worker's share of the step's loss, times the
    # group's size, averages to the step's gradient
    (out.loss * collective.world if collective.world > 1 else out.loss).backward()
    figures = [out.clip_fraction, out.tis_mean, out.tis_truncated_fraction, out.kl, out.ratio_mean]
    return PartResult(
        float(out.loss.detach()), figures, float(mask.sum()), drift, versions[on], freshness, mismatch, drifted
    )


def step_drift(parts: list[PartResult], collective: Collective) -> float:
    """How far the weights being trained have moved from the sampling policy over one step's minibatch: the k3
    estimate of KL(sampling || current), mean over all their tokens (over every
    worker's, in a group)."""
    if len(parts) == 1:  # one pass over the minibatch: its sums divided in float32, as rounds before micro-batches did
        total, tokens = parts[0].drift
        if collective.world == 1:
            return float(total / tokens.clamp(min=1.0))
        total, tokens = collective.sum([float(total), float(tokens)])
        return total / max(tokens, 1.0)
    total, tokens = sum(float(p.drift[0]) for p in parts), sum(float(p.drift[1]) for p in parts)
    if collective.world > 1:
        total, tokens = collective.sum([total, tokens])
    return total / max(tokens, 1.0)


def step_loss_figures(parts: list[PartResult]) -> tuple[float, list[float], float]:
    """A step's loss (its micro-batches' shares add up), token-mean figures and token count."""
    if len(parts) == 1:
        return parts[0].loss, parts[0].figures, parts[0].tokens
    tokens = sum(p.tokens for p in parts)
    figures = [sum(p.figures[i] * p.tokens for p in parts) / max(tokens, 1.0) for i in range(len(parts[0].figures))]
    return sum(p.loss for p in parts), figures, tokens


def step_figures(loss: float, figures: list[float], tokens: float, collective: Collective) -> tuple[float, list[float]]:
    """A step's loss and token-mean figures from each worker's share: the loss shares add up, the means
    weigh each worker by its tokens. In one process they are the figures as computed."""
    if collective.world == 1:
        return loss, figures
    summed = collective.sum([loss, tokens, *(f * tokens for f in figures)])
    return summed[0], [f / max(summed[1], 1.0) for f in summed[2:]]


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) scalar's value; a plain tensor as it is."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


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
    # 'auto' (models.device.engine_dtype) leaves the precision to the engine, whose rows record the one it served at
    if stale_tokens or rollout_dtype not in ("float32", "auto") or any(p < 1.0 for p in top_ps):
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
            stale_tokens=carried_over(batch.policy_versions, current_version),
        )
        for batch in batches
    ]
