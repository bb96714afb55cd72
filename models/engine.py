"""Rollout engines: groups of (prompt x n samples) in, finished samples out as they finish.

The interface is what the rollout stage, the vLLM engine and Ray replicas share:

    engine.generate(groups, should_stop, update) -> Iterator[GeneratedSample]   # in finish order
    engine.load_weights(checkpoint_dir, policy_version)                         # in place, no restart

``EmbeddedEngine`` runs any Hugging Face causal LM with torch on the current process: a KV-cached
decode loop that removes a sequence from the batch the moment it finishes (so the long tail does
not keep finished rows computing) and admits waiting sequences into the freed slots.

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

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from models.policy import cache_argument, cache_of

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 8
    seed: int = 0
    ignore_eos: bool = False  # benchmarks only: generate exactly max_tokens

    def as_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "max_tokens": self.max_tokens}


@dataclass
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
    return GeneratedSample(group.group_id, sample_index, group.prompt_token_ids, [], [], [], ABORT, now, now, 0.0)


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


def greedy_completions(
    engine: Any, tokenizer: Any, prompts: Sequence[Any], max_tokens: int
) -> Iterator[tuple[Any, str, int]]:
    """(prompt, decoded completion, completion tokens) of each prompt's one greedy sample, in finish order.

    ``prompts`` carry ``prompt_id`` and ``text`` (models.addition.Prompt); how an answer is scored is the
    caller's (the evaluation stage's verifier, the base recipe's exact match)."""
    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=max_tokens, seed=0)
    requests = [GroupRequest(p.prompt_id, tuple(tokenizer(p.text)["input_ids"]), 1, params) for p in prompts]
    by_id = {p.prompt_id: p for p in prompts}
    for sample in engine.generate(requests):
        yield (
            by_id[sample.group_id],
            tokenizer.decode(sample.token_ids, skip_special_tokens=True),
            len(sample.token_ids),
        )


def sample_seed(seed: int, group_id: str, sample_index: int) -> int:
    """A per-sample seed that does not depend on batching, so samples reproduce whatever the schedule."""
    import hashlib

    digest = hashlib.blake2b(f"{seed}/{group_id}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class _Sequence:
    group: GroupRequest
    sample_index: int
    seed: int
    started_at: float = 0.0
    tokens: list[int] = field(default_factory=list)  # the generated prefix, carried tokens first
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segment_at: float = 0.0  # when this segment's prefill began
    gen_s: float = 0.0  # generation seconds of earlier segments

    @classmethod
    def of(cls, group: GroupRequest, sample_index: int) -> _Sequence:
        seq = cls(group, sample_index, sample_seed(group.sampling.seed, group.group_id, sample_index))
        carried = group.prefix(sample_index)
        if carried is not None:
            seq.started_at = carried.started_at
            seq.tokens, seq.logprobs = list(carried.token_ids), list(carried.logprobs)
            seq.versions, seq.gen_s = list(carried.token_policy_versions), carried.gen_s
        return seq

    def sample(self, reason: str, now: float) -> GeneratedSample:
        gen_s = self.gen_s + (now - self.segment_at if self.segment_at else 0.0)
        return GeneratedSample(
            self.group.group_id,
            self.sample_index,
            self.group.prompt_token_ids,
            self.tokens,
            self.logprobs,
            self.versions,
            reason,
            self.started_at or now,
            now,
            gen_s,
        )


class EmbeddedEngine:
    """Torch sampling with a KV cache on this process. Default on CPU; works with any HF causal LM."""

    def __init__(
        self,
        model,
        eos_token_id: int,
        pad_token_id: int,
        max_batch: int = 1024,
        policy_version: int = 0,
        update_kv: UpdateKV = "recompute",
    ):
        import torch

        self.update_kv = update_kv
        self.model = model.eval()
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_batch = max_batch
        self.policy_version = policy_version
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.info = EngineInfo(name="embedded", version=f"torch-{torch.__version__}", dtype=dtype)
        self._cache_kwarg = cache_argument(model)

    def load_weights(self, checkpoint_dir: str, policy_version: int) -> float:
        from models.policy import load_state_dict

        state = load_state_dict(checkpoint_dir)  # read before pausing: only the copy blocks serving
        paused = time.perf_counter()
        self.model.load_state_dict(state)
        self.policy_version = policy_version
        return time.perf_counter() - paused

    # -- decoding ------------------------------------------------------------------------------

    def generate(
        self,
        groups: Iterable[GroupRequest],
        should_stop: Callable[[], bool] | None = None,
        update: WeightUpdate | None = None,
    ) -> Iterator[GeneratedSample]:
        """Groups are pulled from ``groups`` only when slots free up, so a caller can stop feeding
        (its iterator ends) the moment it has enough, and in-flight groups still finish; or stop
        them too, through ``should_stop`` (polled before every decode step), and get them back partial.
        ``update``: new weights to load between two decode steps once due (module doc)."""
        import torch

        feed = iter(groups)
        waiting: list[_Sequence] = []  # sequences of pulled groups not yet admitted

        def pull(slots: int) -> list[_Sequence]:
            while len(waiting) < slots:
                group = next(feed, None)
                if group is None:
                    break
                group.check()
                waiting.extend(_Sequence.of(group, i) for i in group.sample_indices())
            admitted, waiting[:] = waiting[:slots], waiting[slots:]
            return admitted

        finished = 0
        with torch.inference_mode():
            batch = _Batch.empty()
            while True:
                if should_stop is not None and should_stop():
                    now = time.time()
                    for s in batch.seqs + waiting:
                        yield s.sample(ABORT, now)
                    return
                recomputed = False
                if update is not None and update.due(finished):
                    directory, version = update.take()
                    batch, recomputed = self._swap(batch, directory, version, update)
                    update = None
                if batch.size and not recomputed:
                    self._decode_step(batch)  # feed the tokens sampled last step; fresh logits for all rows
                # Refill once half the slots are free: one prefill per wave amortises its cost.
                if batch.size <= self.max_batch // 2:
                    admitted = pull(self.max_batch - batch.size)
                    if admitted:
                        batch = batch.merge(self._prefill(admitted))
                if not batch.size:
                    return
                for sample in self._sample_and_retire(batch):
                    finished += 1
                    yield sample

    def _swap(self, batch: _Batch, directory: str, version: int, update: WeightUpdate) -> tuple[_Batch, bool]:
        """Load ``version`` between two decode steps; with ``recompute``, prefill the sequences in flight
        again under it (their next-token logits come from that pass, so the caller skips a decode step)."""
        from models.policy import load_state_dict

        state = load_state_dict(directory)  # read before pausing: only the copy and the recompute block
        paused = time.perf_counter()
        self.model.load_state_dict(state)
        self.policy_version = version
        recompute = self.update_kv == "recompute" and batch.size > 0
        if recompute:
            now = time.time()
            for s in batch.seqs:  # the segment so far counts as generation time; _prefill starts the next
                s.gen_s += now - s.segment_at
            batch = self._prefill(batch.seqs)
        update.applied(time.perf_counter() - paused)
        return batch, recompute

    def _prefill(self, seqs: list[_Sequence]) -> _Batch:
        """Prompt (+ the prefix of a resumed sample), left-padded: [B, width]; logits for the next token.

        A group's fresh samples share their whole input, so each distinct input runs once ([D, width])
        and its cache rows and logits are gathered to one row per sequence: an n-sample group pays
        one prompt's prefill, not n."""
        import torch

        now = time.time()
        index: dict[tuple[int, ...], int] = {}
        owner = []
        for s in seqs:
            s.started_at = s.started_at or now
            s.segment_at = now
            owner.append(index.setdefault((*s.group.prompt_token_ids, *s.tokens), len(index)))
        width = max(len(x) for x in index)
        ids = torch.full((len(index), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(index), width), dtype=torch.long)
        for row, x in enumerate(index):
            ids[row, width - len(x) :] = torch.tensor(x)
            mask[row, width - len(x) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        rows = torch.tensor(owner, dtype=torch.long)
        cache = cache_of(out)
        if len(index) < len(seqs):
            cache.batch_select_indices(rows)  # [D, H, width, Dh] -> [B, H, width, Dh] per layer
        return _Batch(seqs, cache, mask[rows], positions[rows, -1] + 1, out.logits[rows, -1, :].float())

    def _decode_step(self, batch: _Batch) -> None:
        import torch

        ids = batch.last_tokens.unsqueeze(-1)  # [B, 1]
        batch.mask = torch.cat([batch.mask, torch.ones_like(ids)], dim=-1)
        out = self.model(
            input_ids=ids,
            attention_mask=batch.mask,
            position_ids=batch.next_pos.unsqueeze(-1),
            use_cache=True,
            **{self._cache_kwarg: batch.cache},
        )
        batch.cache = cache_of(out)
        batch.next_pos = batch.next_pos + 1
        batch.logits = out.logits[:, -1, :].float()

    def _sample_and_retire(self, batch: _Batch) -> Iterator[GeneratedSample]:
        import torch

        tokens, logprobs = sample_tokens(batch.logits, batch.seqs, self.eos_token_id)
        batch.last_tokens = tokens
        now = time.time()
        keep: list[int] = []
        for row, (s, token, logprob) in enumerate(zip(batch.seqs, tokens.tolist(), logprobs.tolist())):
            s.tokens.append(token)
            s.logprobs.append(logprob)
            s.versions.append(self.policy_version)
            stop = token == self.eos_token_id and not s.group.sampling.ignore_eos
            if stop or len(s.tokens) >= s.group.sampling.max_tokens:
                yield s.sample("stop" if stop else "length", now)
            else:
                keep.append(row)
        if len(keep) < len(batch.seqs):
            batch.select(torch.tensor(keep, dtype=torch.long))


def sample_tokens(logits: torch.Tensor, seqs: list[_Sequence], eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return it and its logprob under the distribution it was drawn from.

    logits: [B, V] float32. Each row uses its own temperature and top-p. Gumbel-max on the processed
    logits is an exact sample of softmax(processed logits); its noise is a hash of (sample seed, token
    position, vocabulary index), so a sample does not depend on which rows shared its batch.
    Temperature 0 is greedy and reports the logprob under the unscaled distribution.
    """
    import torch

    temps = torch.tensor([s.group.sampling.temperature for s in seqs], dtype=logits.dtype)
    top_ps = torch.tensor([s.group.sampling.top_p for s in seqs], dtype=logits.dtype)
    ignore = [row for row, s in enumerate(seqs) if s.group.sampling.ignore_eos]
    if ignore:  # benchmarks: never sample eos when it is ignored
        logits[ignore, eos_token_id] = float("-inf")
    greedy = temps == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(-1)  # [B, V]
    if bool((top_ps < 1).any()):
        scaled = _top_p_filter(scaled, top_ps)
    logp = torch.log_softmax(scaled, dim=-1)  # [B, V]
    seeds = torch.tensor([s.seed for s in seqs], dtype=torch.int64)
    positions = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.int64)
    noise = counter_uniform(seeds, positions, logits.shape[-1])  # [B, V]
    gumbel = -torch.log(-torch.log(noise))
    sampled = torch.where(greedy, scaled.argmax(-1), (logp + gumbel).argmax(-1))  # [B]
    return sampled, logp.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) noise [B, V] from a splitmix64 hash of (seed, position, index): stateless and
    vectorised, so no per-row generator is needed. Integer overflow wraps, as the hash intends."""
    import torch

    index = torch.arange(vocab, dtype=torch.int64)
    x = (seeds * _GOLDEN + positions * _MIX1).unsqueeze(-1) + index * _MIX2  # [B, V]
    for shift, mult in ((30, _MIX1), (27, _MIX2)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mult
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    mantissa = (x >> 11) & ((1 << 53) - 1)  # 53 random bits -> a double in [0, 1)
    return ((mantissa.to(torch.float64) + 0.5) * 2.0**-53).to(torch.float32).clamp(1e-12, 1 - 1e-7)


def _top_p_filter(scaled: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (per row); mask the rest."""
    from models.policy import nucleus_drop  # the trainer's scoring uses the same rule

    return scaled.masked_fill(nucleus_drop(scaled, top_ps.unsqueeze(-1)), float("-inf"))


@dataclass
class _Batch:
    """The running decode batch: sequences, their KV cache and 2-D attention mask (left-padded)."""

    seqs: list[_Sequence]
    cache: object
    mask: torch.Tensor  # [B, L] 1 for real tokens
    next_pos: torch.Tensor  # [B] position id of the next token
    logits: torch.Tensor  # [B, V] logits for the next token
    last_tokens: torch.Tensor | None = None

    @classmethod
    def empty(cls) -> _Batch:
        return cls([], None, None, None, None)  # type: ignore[arg-type]

    @property
    def size(self) -> int:
        return len(self.seqs)

    def select(self, rows: torch.Tensor) -> None:
        self.seqs = [self.seqs[i] for i in rows.tolist()]
        if not self.seqs:
            self.cache = None
            return
        self.cache.batch_select_indices(rows)
        self.mask, self.next_pos, self.logits = self.mask[rows], self.next_pos[rows], self.logits[rows]
        self.last_tokens = self.last_tokens[rows]
        self._trim()

    def _trim(self) -> None:
        """Drop the leading columns no remaining row uses. Rows are left-padded, so once the longest
        sequence has left, its padding is all that is left of those columns; without this the mask and
        cache keep growing one column per step for as long as the batch keeps running (refilled waves
        never empty it), and every step and every merge pays for the whole history."""
        import torch

        used = self.mask.any(dim=0)  # [L]
        first = int(used.to(torch.int8).argmax())
        if first == 0:
            return
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, first:, :]
            layer.values = layer.values[:, :, first:, :]

    def merge(self, new: _Batch) -> _Batch:
        """Join a freshly prefilled wave to the running batch; both must have logits ready.

        Rows of different lengths share one cache by left-padding the shorter side with masked zeros.
        """
        if not self.seqs:
            return new
        import torch
        from transformers import DynamicCache

        width = max(self.mask.shape[1], new.mask.shape[1])

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        layers = [
            (torch.cat([pad(a.keys, 2), pad(b.keys, 2)]), torch.cat([pad(a.values, 2), pad(b.values, 2)]))
            for a, b in zip(self.cache.layers, new.cache.layers)
        ]
        return _Batch(
            self.seqs + new.seqs,
            DynamicCache(ddp_cache_data=layers),
            torch.cat([pad(self.mask, 1), pad(new.mask, 1)]),
            torch.cat([self.next_pos, new.next_pos]),
            torch.cat([self.logits, new.logits]),
        )
