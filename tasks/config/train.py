"""The train section: the optimizer, the PPO-style loss and how a round's groups are split into updates."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.config.base import Config


class TrainConfig(Config):
    """How the policy is updated from one round's trajectories."""

    learning_rate: float = Field(1e-4, gt=0.0, le=1.0)
    """AdamW learning rate. 1e-4 is safe for the built-in policy; 5e-4 collapsed it in measurements."""
    groups_per_step: int = Field(128, ge=1)
    """Groups (prompts x samples_per_prompt) per optimizer step. By default 128 prompts x 4 samples: on the
    built-in task that learned faster than 64 x 8, the same samples over half the prompts (README, Where a
    round's seconds go)."""
    steps_per_round: int = Field(16, ge=1)
    """Optimizer steps per round. The round's trainable batch is groups_per_step x steps_per_round groups."""
    epochs: int = Field(2, ge=1, le=16)
    """Passes over the round's trainable groups: each pass takes ``steps_per_round`` steps over the same
    minibatches in the same order, so a round makes epochs x steps_per_round updates from one rollout.
    Later passes train on rows the policy has moved away from, which the PPO clip bounds. On the
    built-in task 2 reached 90% in 0.6x the seconds of 1 (139 s against 230 s), and 3 no sooner than 2 (README, Where a
    round's seconds go)."""
    max_kl: float | None = Field(0.08, gt=0.0)
    """Stop the round's updates once the policy has moved this far from the one that sampled its rows: the
    k3 estimate of KL(sampling || current) over a minibatch's tokens, measured before its update (PPO's
    target KL). A sharp policy moves further per step: on the built-in task a round's updates drifted
    0.03 early in the campaign and 0.3-0.9 after round 35, and accuracy fell from 97% to 88%. Rounds
    that stay within it run every update. None: never stop early."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Global gradient-norm clip."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """PPO clip below 1 (ratio >= 1 - clip_low)."""
    clip_high: float = Field(0.2, ge=0.0, le=10.0)
    """PPO clip above 1 (ratio <= 1 + clip_high); raise it for DAPO-style clip-higher."""
    tis_cap: float = Field(2.0, ge=1.0)
    """Truncation cap of the engine/trainer importance weight."""
    minibatch_order: Literal["shuffled", "stored"] = "shuffled"
    """Which groups share a minibatch. 'shuffled': a seeded hash of each group id orders them (the same
    order on every run of the same rows, so a replay makes the same updates). 'stored': the trajectory's
    stored order, which is the order the groups finished in, so the first minibatches hold the shortest
    groups and, with partial rollouts, the resumed long ones: that minibatch's drift then stops the
    round's updates early (README, Rounds that do not wait for the long tail)."""
    recompute_proximal: Literal["auto", "always", "never"] = "auto"
    """Recompute the trainer's logprobs at the sampling weights before training ('proximal' policy),
    enabling the truncated importance-sampling correction. 'auto': unless the rows come from the
    embedded fp32 engine with top_p 1, where engine and trainer agree to ~1e-6 and the extra forward
    pass is waste."""
    aggregation: Literal["token", "sequence", "dr_grpo"] = "token"
    """Loss aggregation: 'token' (mean over all completion tokens of a minibatch), 'sequence' (mean over
    each sample's tokens, then over samples), or 'dr_grpo' (sum over tokens / (samples x rollout
    max_tokens), a constant that leaves no length bias; pair it with filter.normalize_std=false)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of a k3 KL penalty to the reference policy named by ``kl_reference`` (0: none is loaded)."""
    kl_reference: Literal["base", "parent"] = "base"
    """Reference policy of the KL penalty. 'base': the campaign's starting policy, a fixed anchor the
    whole campaign is pulled towards. 'parent': the checkpoint the round starts from, a moving trust
    region that only limits how far one round moves."""
    seed: int = 0
    """Seed for anything random in training. Dropout is never active (the policy trains in eval mode),
    so on CPU an update is a function of the weights and the stored rows alone."""

    @classmethod
    def recorded(cls, recorded: dict) -> TrainConfig:
        """A training config as a round's lineage recorded it. A field added since trains, when absent, the
        way rounds did before it existed (``BEFORE_FIELDS``), not by today's default: a replay of an older
        round must make the same updates."""
        return cls.model_validate({**BEFORE_FIELDS, **recorded})


BEFORE_FIELDS: dict = {"epochs": 1, "max_kl": None, "minibatch_order": "stored"}
"""How rounds trained before these ``TrainConfig`` fields existed: one pass, no drift limit, minibatches
in stored order."""
