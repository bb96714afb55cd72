"""GRPO-style policy-gradient loss: pure tensor math with its shapes stated.

Notation per completion token t of sample i:
    logp[i,t]        log pi_theta(token)           trainer, current weights (carries gradient)
    behaviour[i,t]   log mu(token)                 engine, at sampling time
    proximal[i,t]    log pi_old(token)             trainer at the weights the engine sampled with
                                                   (optional; None -> behaviour stands in)
    A[i]             group-normalised advantage of sample i (or A[i,t] per token: train.credit 'prefix')

    ratio = exp(logp - proximal)                                    # PPO trust region on the trainer's own numbers
    tis   = min(exp(proximal - behaviour), tis_cap)  (detached)     # engine/trainer mismatch correction
    loss  = -tis * min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)  [+ kl_coef * k3(logp, ref)]

Aggregation of the per-token loss over a minibatch of B samples (split across N trainer workers, each
takes its rows' share of the whole minibatch's sum over the whole minibatch's denominator, ``StepTotals``,
so the shares add up to the loss one worker computes):
    token     sum over every completion token / number of completion tokens (long answers weigh more)
    sequence  mean over each sample's tokens, then mean over samples (every sample weighs the same)
    dr_grpo   sum over every completion token / (B * max_tokens), max_tokens the sampling limit:
              a constant denominator, so neither a sample's length nor the batch's token count rescales
              its tokens' gradient (Dr. GRPO, "Understanding R1-Zero-Like Training")
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class LossInputs:
    logprobs: torch.Tensor  # [B, T] trainer logprobs, with grad
    behaviour_logprobs: torch.Tensor  # [B, T] engine logprobs
    advantages: torch.Tensor  # [B], or [B, T] per token (train.credit 'prefix')
    mask: torch.Tensor  # [B, T] 1.0 on completion tokens
    proximal_logprobs: torch.Tensor | None = None  # [B, T]
    ref_logprobs: torch.Tensor | None = None  # [B, T] reference policy, for the KL penalty
    max_tokens: int | None = None  # the sampling limit on completion tokens; dr_grpo divides by B * it
    step: StepTotals | None = None  # the whole minibatch's counts when these rows are one worker's share


@dataclass(frozen=True)
class StepTotals:
    """The whole minibatch's denominators, for a worker that holds a share of its rows."""

    tokens: int  # completion tokens
    samples: int
    max_tokens: int | None  # the sampling limit (dr_grpo)


@dataclass(frozen=True)
class LossSettings:
    clip_low: float = 0.2
    clip_high: float = 0.2
    tis_cap: float = 2.0
    aggregation: str = "token"  # token | sequence | dr_grpo
    kl_coef: float = 0.0


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    clip_fraction: float  # share of tokens whose ratio left the trust region in the direction of A
    ratio_mean: float
    tis_mean: float  # mean truncated importance weight (1.0 when engine and trainer agree)
    tis_truncated_fraction: float
    kl: float  # k3 estimate of KL(pi_theta || ref), 0 without a reference


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, how: str, max_tokens: int | None = None, step: StepTotals | None = None
) -> torch.Tensor:
    """[B, T] -> scalar. ``max_tokens`` (the sampling limit) is needed by 'dr_grpo' only. With ``step``, these
    rows are a share of a minibatch: their sum over the minibatch's denominator."""
    if how not in ("token", "sequence", "dr_grpo"):
        raise ValueError(f"unknown loss aggregation {how!r}; use 'token', 'sequence' or 'dr_grpo'")
    if step is not None:
        if how == "token":
            return (per_token * mask).sum() / max(step.tokens, 1)
        if how == "sequence":
            return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / step.samples
        return (per_token * mask).sum() / (step.samples * _limit(step.max_tokens))
    if how == "token":
        return masked_mean(per_token, mask)
    if how == "sequence":
        per_sample = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B]
        return per_sample.mean()
    return (per_token * mask).sum() / (per_token.shape[0] * _limit(max_tokens))


def _limit(max_tokens: int | None) -> int:
    if not max_tokens or max_tokens < 1:
        raise ValueError(
            "loss aggregation 'dr_grpo' divides by samples x max_tokens; pass the sampling limit max_tokens >= 1"
        )
    return max_tokens


def policy_loss(x: LossInputs, s: LossSettings) -> LossOutput:
    mask = x.mask.float()
    proximal = x.behaviour_logprobs if x.proximal_logprobs is None else x.proximal_logprobs
    adv = x.advantages if x.advantages.dim() == 2 else x.advantages.unsqueeze(-1)  # [B, T] or [B, 1]
    ratio = torch.exp(x.logprobs - proximal)  # [B, T]
    clipped = ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)  # [B, T]
    if x.proximal_logprobs is None:
        tis = torch.ones_like(ratio)
    else:
        raw = torch.exp(x.proximal_logprobs - x.behaviour_logprobs).detach()
        tis = raw.clamp(max=s.tis_cap)
    per_token = -tis * surrogate
    kl = torch.zeros((), dtype=per_token.dtype)
    if x.ref_logprobs is not None:
        # k3 estimator: exp(ref - logp) - (ref - logp) - 1  >= 0, unbiased for KL(pi || ref)
        delta = x.ref_logprobs - x.logprobs
        k3 = torch.exp(delta) - delta - 1.0
        kl = masked_mean(k3, mask)
        per_token = per_token + s.kl_coef * k3
    loss = aggregate(per_token, mask, s.aggregation, x.max_tokens, x.step)
    with torch.no_grad():
        was_clipped = ((ratio * adv) > (clipped * adv)).float()
        truncated = (
            (tis < torch.exp(proximal - x.behaviour_logprobs) - 1e-12).float()
            if x.proximal_logprobs is not None
            else torch.zeros_like(ratio)
        )
        return LossOutput(
            loss=loss,
            clip_fraction=float(masked_mean(was_clipped, mask)),
            ratio_mean=float(masked_mean(ratio, mask)),
            tis_mean=float(masked_mean(tis, mask)),
            tis_truncated_fraction=float(masked_mean(truncated, mask)),
            kl=float(kl),
        )


def logprob_mismatch(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's logprobs are from the trainer's on the same tokens and weights.

    trainer, engine, mask: [B, T]. Returns mean and max |delta|, a k3 estimate of KL(mu || pi), and the
    number of tokens they cover (to pool minibatches with ``pooled_mismatch``).
    """
    with torch.no_grad():
        m = mask.float()
        delta = (trainer - engine) * m
        k3 = (torch.exp(delta) - delta - 1.0) * m
        return {
            "mean_abs": float(delta.abs().sum() / m.sum().clamp(min=1.0)),
            "max_abs": float(delta.abs().max()) if m.sum() > 0 else 0.0,
            "kl": float(k3.sum() / m.sum().clamp(min=1.0)),
            "tokens": float(m.sum()),
        }


def pooled_mismatch(parts: list[dict[str, float]]) -> dict[str, float]:
    """Several minibatches' ``logprob_mismatch`` as one, every token weighing the same."""
    tokens = sum(p["tokens"] for p in parts)
    if not tokens:
        return {"mean_abs": 0.0, "max_abs": 0.0, "kl": 0.0, "tokens": 0.0}
    return {
        "mean_abs": sum(p["mean_abs"] * p["tokens"] for p in parts) / tokens,
        "max_abs": max(p["max_abs"] for p in parts),
        "kl": sum(p["kl"] * p["tokens"] for p in parts) / tokens,
        "tokens": tokens,
    }
