"""The filter section: how rewards become advantages, and which samples train."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from tasks.config.base import AddedInput, Config


class FilterConfig(Config):
    """How rewards become advantages, and which samples are trained on."""

    normalize_std: bool = True
    """Divide group-centred rewards by the group's standard deviation (GRPO). Off: Dr. GRPO-style centring only."""
    drop_zero_variance: bool = True
    """Drop groups whose samples all scored the same: their advantages are all zero."""
    history_baseline_rounds: Annotated[int | None, AddedInput(since="2026-12-07", keyed_at_default=False)] = Field(
        None, ge=1
    )
    """A group that all scored the same trains against its prompt's success rate over this many past committed
    rounds (at least 4 scored samples, strictly between 0 and 1) instead of being dropped. None: dropped."""
    keep_samples: Annotated[int | None, AddedInput(since="2026-12-07", keyed_at_default=False)] = Field(None, ge=2)
    """Train on at most this many of a group's scored samples: those whose rewards vary most (the highest and
    lowest, equal rewards by sample index); the rest are dropped ('down_sampled') before advantages. None: all."""
    min_scored_per_group: int = Field(2, ge=2)
    """A group needs at least this many scored samples (after dropping infra failures) to be compared."""
    epsilon: float = Field(1e-6, gt=0)
    """Added to the standard deviation so near-constant groups do not explode."""
    max_staleness: int | None = Field(None, ge=0)
    """Most policy versions a sample's oldest token may lag the policy it trains (the round's parent); older samples
    are dropped ('stale') and their group's advantages computed without them. None: no bound (train.tis_cap's
    truncated importance weights still correct them)."""
    overlong: Literal["keep", "drop", "penalty"] = "keep"
    """Samples cut at rollout.max_tokens: 'keep' them as scored; 'drop' them from training ('overlong'); or
    'penalty': add a reward penalty over the last overlong_buffer tokens before the limit, falling linearly from 0
    to -1 at it (DAPO)."""
    overlong_buffer: int = Field(4, ge=1)
    """Tokens before the sampling limit over which the 'penalty' rule ramps."""

    @model_validator(mode="after")
    def _keeps_enough_to_compare(self) -> FilterConfig:
        if self.keep_samples is not None and self.keep_samples < self.min_scored_per_group:
            raise ValueError(
                f"filter.keep_samples ({self.keep_samples}) is below filter.min_scored_per_group "
                f"({self.min_scored_per_group}): no group would keep enough samples to train; raise keep_samples"
            )
        return self
