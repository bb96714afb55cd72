"""The rollout engine interface: groups of (prompt x n samples) in, finished samples out as they finish.

``RolloutEngine`` is what the rollout, evaluation and publish stages drive, and what the embedded
engine, the vLLM engine and a set of Ray replicas implement:

    engine.generate(groups, should_stop, update) -> Iterator[GeneratedSample]   # in finish order
    engine.load_weights(checkpoint_dir, policy_version) -> pause seconds        # in place, no restart

Partial rollouts. ``should_stop`` is polled once per decode step; when it answers True the engine
stops pulling groups and yields every sample it still holds as a *partial* sample
(``finish_reason='abort'``): its generated prefix with each token's behaviour logprob and policy
version (an empty prefix for a sample never admitted). A later call continues it: a ``GroupRequest``
whose ``resume`` holds partial samples generates only those, from prompt + prefix, and the tokens it
appends carry the policy version served then. A stopped sample's KV cache is dropped, not kept: on
resume the prompt + prefix is prefilled again (one parallel forward pass, far cheaper than the
decode steps that produced the prefix), and the weights have usually changed by then anyway, which
makes the old cache stale. Sampling noise is a function of (sample seed, token position, vocabulary
index), so a resumed sample draws the same noise at each position it would have drawn uninterrupted.

Weight updates in flight (overlap mode). ``update`` (a ``WeightUpdate``) is asked before every decode
step whether the next policy is due, given how many samples this call has finished; when it is, the
engine waits for the checkpoint (``take``), loads it between two decode steps and goes on: tokens
sampled after that carry the new version, so a sample in flight spans both. What happens to the
sequences in flight is ``update_kv``:

    recompute  (default) their prompt + prefix is prefilled again under the new weights, in one
               parallel pass, so every later token's logprob is exactly the new policy's
    keep       their KV cache, computed by the old weights, is kept; later tokens are sampled from a
               mixture the trainer cannot reproduce under either version (a measured mismatch,
               benchmarks/weight_update.py)

The point is a count of finished samples, not a time, so a round's rows do not depend on how fast
the trainer was: the engine waits there for the weights if they are late.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 8
    seed: int = 0
    ignore_eos: bool = False  # benchmarks only: generate exactly max_tokens
    stop: tuple[str, ...] = ()  # a sample also ends (finish_reason 'stop') on the token that completes one of these

    def as_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "max_tokens": self.max_tokens}


@dataclass(kw_only=True)
class GeneratedSample:
    group_id: str
    sample_index: int
    prompt_token_ids: tuple[int, ...]
    token_ids: list[int]
    logprobs: list[float]  # behaviour logprobs of the sampled tokens under the sampling distribution
    token_policy_versions: list[int]
    finish_reason: str  # stop | length | abort (abort: stopped unfinished; token_ids is the prefix to resume)
    started_at: float  # time.time() when its first prefill began (the first segment, if it was resumed)
    finished_at: float  # when it finished, or was stopped
    gen_s: float = 0.0  # seconds spent generating, summed over its segments (excludes time parked between them)

    @property
    def partial(self) -> bool:
        return self.finish_reason == ABORT


ABORT = "abort"


@dataclass(frozen=True)
class GroupRequest:
    """One prompt to be sampled ``n`` times; the unit the router keeps on one replica.

    ``resume``: partial samples of this group to continue (each with ``finish_reason='abort'``); when
    given, only these samples are generated, each from prompt + its prefix, up to ``max_tokens`` in all."""

    group_id: str
    prompt_token_ids: tuple[int, ...]
    n: int
    sampling: SamplingParams
    resume: tuple[GeneratedSample, ...] = ()

    def check(self) -> None:
        if self.n < 1 or self.sampling.max_tokens < 1:
            raise ValueError(f"group {self.group_id}: n and max_tokens must be >= 1")
        for p in self.resume:
            if p.group_id != self.group_id or not p.partial or not 0 <= p.sample_index < self.n:
                raise ValueError(
                    f"group {self.group_id}: resume holds sample {p.group_id}/{p.sample_index} "
                    f"({p.finish_reason}); only this group's partial samples (finish_reason 'abort') resume"
                )
            if len(p.token_ids) >= self.sampling.max_tokens:
                raise ValueError(
                    f"group {self.group_id}: partial sample {p.sample_index} already has max_tokens tokens"
                )

    def sample_indices(self) -> list[int]:
        return [p.sample_index for p in self.resume] if self.resume else list(range(self.n))

    def prefix(self, sample_index: int) -> GeneratedSample | None:
        return next((p for p in self.resume if p.sample_index == sample_index), None)


def unstarted(group: GroupRequest, sample_index: int, now: float) -> GeneratedSample:
    """The partial sample of one that was never admitted: an empty prefix (or its carried one)."""
    carried = group.prefix(sample_index)
    if carried is not None:
        return carried
    return GeneratedSample(
        group_id=group.group_id,
        sample_index=sample_index,
        prompt_token_ids=group.prompt_token_ids,
        token_ids=[],
        logprobs=[],
        token_policy_versions=[],
        finish_reason=ABORT,
        started_at=now,
        finished_at=now,
        gen_s=0.0,
    )


class WeightUpdate(Protocol):
    """The next policy, handed to an engine while it generates (see the module doc)."""

    def due(self, finished: int) -> bool:
        """Polled before each decode step with the samples this call has finished: load it now?"""
        ...

    def take(self) -> tuple[str, int]:
        """(local checkpoint directory, policy version); blocks until the checkpoint is committed."""
        ...

    def applied(self, pause_s: float) -> None:
        """The engine served the new weights after pausing ``pause_s`` seconds (load + recompute)."""
        ...


UpdateKV = Literal["recompute", "keep"]


@dataclass(frozen=True)
class EngineInfo:
    name: str
    version: str
    dtype: str


@runtime_checkable
class RolloutEngine(Protocol):
    """A policy served for sampling: the embedded engine (models/engines/embedded.py), the vLLM engine
    (models/engines/vllm_engine.py) and a set of Ray replicas (models/engines/replicas.py) each
    subclass it, and tests/test_engine_interface.py checks that each defines every member itself."""

    info: EngineInfo
    """What generates the samples (name, version, dtype): recorded with every row it produces."""
    policy_version: int
    """The policy version of the weights served now: the one each newly sampled token is labelled with."""
    decode_steps: int
    """Decode steps run since the engine was made (prefills not counted). Where a step costs about the
    same whatever its batch (an accelerator below its batch limit), rollout time goes with this count,
    not with the tokens generated (benchmarks/batch_collection.py)."""

    def generate(
        self,
        groups: Iterable[GroupRequest],
        should_stop: Callable[[], bool] | None = None,
        update: WeightUpdate | None = None,
    ) -> Iterator[GeneratedSample]:
        """Every sample of ``groups`` (``n`` a group, or its ``resume`` ones), yielded as it finishes.

        Groups are pulled from ``groups`` only as the engine has room, so a caller can stop feeding
        (its iterator ends) the moment it has enough, and the groups already pulled still finish.
        ``should_stop`` is polled before every decode step; once it answers True no more groups are
        pulled and every sample still held, admitted or not, is yielded partial (module doc).
        ``update``: new weights to load between two decode steps once due (module doc). A caller
        that stops iterating early leaves nothing generating."""
        ...

    def load_weights(self, checkpoint_dir: str, policy_version: int) -> float:
        """Serve the checkpoint in ``checkpoint_dir`` as ``policy_version``, loaded in place (no restart),
        between two calls; returns the seconds the engine could not serve."""
        ...

    def configure(self, max_batch: int, update_kv: UpdateKV) -> None:
        """Settings of the next calls of a live engine, which a campaign reuses across rounds and
        stages: ``max_batch``, the most samples in flight; ``update_kv``, what an ``update`` does to
        the sequences in flight (module doc)."""
        ...

    def close(self) -> None:
        """Release the engine's processes and memory now rather than at interpreter exit."""
        ...


@runtime_checkable
class WeightReceiver(Protocol):
    """An engine that can also take new weights from memory, as the trainer holds them, instead of
    reading a checkpoint: the vLLM engine on a GPU (CUDA IPC) and a set of vLLM replicas on GPUs (NCCL).
    The checkpoint of the same weights is still written: it is what lineage, resumes and evaluation read."""

    weights_from_memory: bool
    """Whether ``push_weights`` can serve weights here (False on a CPU: only ``load_weights`` then)."""

    def push_weights(self, weights: Mapping[str, torch.Tensor], policy_version: int) -> float:
        """Serve ``weights`` (Hugging Face parameter names -> tensors on the trainer's GPU, left unchanged
        until this returns) as ``policy_version``; returns the seconds the engine could not serve."""
        ...


def sample_seed(seed: int, group_id: str, sample_index: int) -> int:
    """A per-sample seed that does not depend on batching, so samples reproduce whatever the schedule."""
    digest = hashlib.blake2b(f"{seed}/{group_id}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF
