"""The train section: the optimizer, the PPO-style loss and how a round's groups are split into updates."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from tasks.config.base import AddedInput, Config, NotInput


class LoraConfig(Config):
    """Low-rank adapters (LoRA, with ``peft``) trained in place of the policy's own weights."""

    rank: int = Field(16, ge=1, le=4096)
    """Rank of each adapter's two factors."""
    alpha: float = Field(32.0, gt=0.0)
    """Scale of the adapters' output: their product is multiplied by alpha / rank."""
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Names of the linear layers that get an adapter (the attention and MLP projections of Llama-shaped models)."""
    dropout: float = 0.0
    """Dropout on the adapters' input. Must be 0: the policy trains in eval mode, where dropout never runs (see
    ``train.seed``), so any other value would be silently ignored."""

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError(
                "train.lora.dropout must be 0: the policy trains in eval mode (dropout would make the trainer score "
                "another policy than the engine sampled from); set train.lora.dropout: 0"
            )
        return value


class TrainConfig(Config):
    """How the policy is updated from one round's trajectories."""

    learning_rate: float = Field(1e-4, gt=0.0, le=1.0)
    """AdamW learning rate."""
    groups_per_step: int = Field(128, ge=1)
    """Groups (prompts x samples_per_prompt) per optimizer step."""
    steps_per_round: int = Field(16, ge=1)
    """Optimizer steps per round. The round's trainable batch is groups_per_step x steps_per_round groups."""
    epochs: int = Field(2, ge=1, le=16)
    """Passes over the round's trainable groups, each taking steps_per_round steps over the same minibatches in the
    same order: epochs x steps_per_round updates from one rollout. Later passes train on rows the policy has moved
    from, which the PPO clip bounds."""
    max_kl: float | None = Field(0.08, gt=0.0)
    """Stop the round's updates once the policy has drifted this far from the one that sampled its rows: the k3
    estimate of KL(sampling || current) over a minibatch's tokens, before its update (PPO's target KL). None: never
    stop early."""
    warmup_steps: Annotated[int, AddedInput(since="2026-12-07", keyed_at_default=False)] = Field(8, ge=0)
    """Ramp the learning rate linearly over the optimizer's first this many steps (a fresh Adam's first steps are
    sign steps of the whole rate). Optimizer state carries between rounds: only a campaign's first steps ramp (LoRA:
    each round's). 0: none."""
    drift_target: Annotated[float | None, AddedInput(since="2026-12-07", keyed_at_default=False)] = Field(None, gt=0.0)
    """Scale the learning rate between rounds toward ending a round at this drift: x1.5 after one ending below
    half of it, /1.5 after one stopped at max_kl or above twice it (within 1/8-8x; kept in the optimizer state).
    None: fixed."""
    adam_beta2: Annotated[float, AddedInput(since="2026-12-07", keyed_at_default=False)] = Field(0.999, gt=0.0, lt=1.0)
    """AdamW's second-moment decay: lower forgets old gradient scales sooner, so later steps grow as gradients shrink.
    0.99 reached 90% later than 0.999 in the default campaign (docs/performance.md)."""
    credit: Annotated[Literal["sample", "prefix"], AddedInput(since="2026-12-07", keyed_at_default=False)] = "sample"
    """How a sample's advantage reaches its tokens. 'sample': every token takes it (GRPO). 'prefix': a token takes the
    change it makes to the mean advantage of its group's samples sharing its prefix, so credit lands where samples
    part ways."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Global gradient-norm clip."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """PPO clip below 1 (ratio >= 1 - clip_low)."""
    clip_high: float = Field(0.28, ge=0.0, le=10.0)
    """PPO clip above 1 (ratio <= 1 + clip_high), above clip_low (DAPO's clip-higher): a right token gains more
    before its gradient stops. 0.28 reached 90% in fewer rounds than 0.2 in 9 of 12 seeds (docs/training.md)."""
    tis_cap: float = Field(2.0, ge=1.0)
    """Truncation cap of the engine/trainer importance weight."""
    minibatch_order: Literal["shuffled", "carried_first", "stored"] = "carried_first"
    """Which groups share a minibatch. 'shuffled': a seeded hash of each group id orders them; a replay makes the same
    updates. 'carried_first': so, but groups holding carried-over tokens first, so fewer minibatches need the proximal
    pass. 'stored': finish order."""
    recompute_proximal: Literal["auto", "always", "never"] = "auto"
    """Recompute the trainer's logprobs at the sampling weights before training (the 'proximal' policy) for the
    truncated importance-sampling correction. 'auto': except for rows from the embedded float32 engine with top_p 1,
    whose logprobs already match the trainer's."""
    aggregation: Literal["token", "sequence", "dr_grpo"] = "token"
    """Loss aggregation: 'token' (mean over a minibatch's completion tokens), 'sequence' (mean over each sample's
    tokens, then over samples), or 'dr_grpo' (sum over tokens / (samples x rollout.max_tokens), no length bias; pair
    it with filter.normalize_std=false)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of a k3 KL penalty to the reference policy named by ``kl_reference`` (0: none is loaded)."""
    kl_reference: Literal["base", "parent"] = "base"
    """Reference policy of the KL penalty. 'base': the campaign's starting policy, a fixed anchor the
    whole campaign is pulled towards. 'parent': the checkpoint the round starts from, a moving trust
    region that only limits how far one round moves."""
    workers: Annotated[int, AddedInput(since="2026-11")] = Field(1, ge=1, le=4096)
    """Trainer processes. 1: in the round's own process. N > 1: N Ray actors started once per campaign shard the
    policy and optimizer state with FSDP2 and split each step's groups, making the update one would."""
    precision: Annotated[Literal["auto", "fp32", "bf16"], AddedInput(since="2026-11")] = "auto"
    """Training precision: 'fp32', or 'bf16' autocast over fp32 master weights and optimizer state. 'auto': bf16 on
    CUDA, fp32 on the CPU."""
    max_tokens_per_microbatch: Annotated[
        int | None, NotInput("the same update to float rounding, in bounded memory")
    ] = Field(None, ge=1)
    """Back-propagate each minibatch in micro-batches of at most this many padded tokens, gradients accumulated into
    its one step under the whole minibatch's loss normalisation: the same update to float rounding, bounded
    activation memory. None: one pass."""
    gradient_checkpointing: Annotated[bool, NotInput("the same update to float rounding, in less memory")] = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them: less memory, about
    one more forward pass. Samples are then scored over whole sequences (no shared prompt cache). Same update to
    float rounding."""
    lora: Annotated[LoraConfig | None, AddedInput(since="2026-12-04", keyed_at_default=False)] = None
    """Train low-rank adapters instead of every weight: each round adds fresh adapters to its parent and trains only
    them; the checkpoint holds the policy with them merged (what engines load) and the adapters in adapter/. None:
    full fine-tuning."""
    seed: int = 0
    """Seed for anything random in training. Dropout is never active (the policy trains in eval mode),
    so on CPU an update is a function of the weights and the stored rows alone."""

    @classmethod
    def recorded(cls, recorded: dict) -> TrainConfig:
        """A training config as a round's lineage recorded it. A field added since trains, when absent, the
        way rounds did before it existed (``BEFORE_FIELDS``), not by today's default: a replay of an older
        round must make the same updates."""
        return cls.model_validate({**BEFORE_FIELDS, **recorded})


BEFORE_FIELDS: dict = {"epochs": 1, "max_kl": None, "minibatch_order": "stored", "clip_high": 0.2, "warmup_steps": 0}
"""How rounds trained before these ``TrainConfig`` fields existed, or before their defaults changed: one pass, no
drift limit, minibatches in stored order, the upper clip equal to the lower one, no warm-up."""
