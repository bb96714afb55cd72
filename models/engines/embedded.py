"""The embedded engine: any Hugging Face causal LM sampled with torch in this process.

``EmbeddedEngine`` runs any Hugging Face causal LM with torch on the current process: a KV-cached
decode loop that removes a sequence from the batch the moment it finishes (so the long tail does
not keep finished rows computing) and admits waiting sequences into the freed slots. Its KV cache
(models/engines/kv_cache.py) is a preallocated slot per sequence for Llama-family models, transformers' own
cache for any other.

It serves on the device its model is on (``models.checkpoint.load_policy(..., device=)``): the KV cache, the
sampling noise and every mask live there, and what it yields (token ids, logprobs) is plain Python.

It is a ``RolloutEngine`` (models/engines/types.py: partial rollouts, weight updates in flight).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from models.checkpoint import assign_weights, load_state_dict
from models.engines import speculative
from models.engines.kv_cache import PaddedCache, SlotCache, distinct_inputs, slot_cache_applies
from models.engines.speculative import Follow, Speculation, SpeculationStats, follow_on
from models.engines.types import (
    ABORT,
    EngineInfo,
    GeneratedSample,
    GroupRequest,
    RolloutEngine,
    UpdateKV,
    WeightUpdate,
    sample_seed,
)
from models.logprobs import nucleus_drop  # the trainer's scoring uses the same rule


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
    follow: Follow | None = None  # speculation: the reference this sample drafts from
    draft_len: int = 0  # speculation: the most tokens its next draft takes (0: k)

    @classmethod
    def of(cls, group: GroupRequest, sample_index: int) -> _Sequence:
        seq = cls(group, sample_index, sample_seed(group.sampling.seed, group.group_id, sample_index))
        if not group.resume:
            return seq
        carried = group.prefix(sample_index)
        if carried is not None:
            seq.started_at = carried.started_at
            seq.tokens, seq.logprobs = list(carried.token_ids), list(carried.logprobs)
            seq.versions, seq.gen_s = list(carried.token_policy_versions), carried.gen_s
        return seq

    def sample(self, reason: str, now: float) -> GeneratedSample:
        gen_s = self.gen_s + (now - self.segment_at if self.segment_at else 0.0)
        return GeneratedSample(
            group_id=self.group.group_id,
            sample_index=self.sample_index,
            prompt_token_ids=self.group.prompt_token_ids,
            token_ids=self.tokens,
            logprobs=self.logprobs,
            token_policy_versions=self.versions,
            finish_reason=reason,
            started_at=self.started_at or now,
            finished_at=now,
            gen_s=gen_s,
        )


KVCacheKind = Literal["auto", "slots", "padded"]


class EmbeddedEngine(RolloutEngine):
    """Torch sampling with a KV cache on this process, on the model's device; works with any HF causal LM.

    ``kv_cache``: ``slots`` (Llama-family models: preallocated per-sequence slots and a decode written
    against them), ``padded`` (transformers' own cache and forward, any causal LM), or ``auto``: slots
    where they apply (models/engines/kv_cache.py)."""

    def __init__(
        self,
        model,
        eos_token_id: int | Iterable[int],
        pad_token_id: int,
        max_batch: int = 1024,
        policy_version: int = 0,
        update_kv: UpdateKV = "recompute",
        kv_cache: KVCacheKind = "auto",
        decode: Callable[[Sequence[int]], str] | None = None,
    ):
        """``eos_token_id``: the token, or tokens, that end a sample (``models.checkpoint.stop_token_ids``: the
        tokenizer's and the generation config's). ``decode``: token ids to text, to match ``SamplingParams.stop``
        strings (without it, a request with stop strings is refused)."""
        self.update_kv = update_kv
        self.model = model.eval()
        self.stop_token_ids = frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        self.pad_token_id = pad_token_id
        self.decode = decode
        self.max_batch = max_batch
        self.policy_version = policy_version
        self.device = next(model.parameters()).device
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.info = EngineInfo(name="embedded", version=f"torch-{torch.__version__}", dtype=dtype)
        self._kv_setting = kv_cache
        self.decode_steps = 0
        self._speculation: Speculation | None = None
        self.speculation_stats = SpeculationStats()
        self.kv_cache  # noqa: B018 -- fails now, not at the first generate, if 'slots' cannot serve the model

    @property
    def kv_cache(self) -> str:
        """The KV cache the next ``generate`` uses: 'slots' or 'padded' (``max_batch`` may change between
        calls). Raises if ``kv_cache='slots'`` was asked for and cannot serve this model at this size."""
        if self._kv_setting == "padded":
            return "padded"
        positions = getattr(self.model.config, "max_position_embeddings", None) or 4096
        why_not = slot_cache_applies(self.model, self.max_batch, positions)
        if why_not and self._kv_setting == "slots":
            raise ValueError(f"kv_cache='slots' cannot serve this model: {why_not}")
        return "padded" if why_not else "slots"

    def configure(self, max_batch: int, update_kv: UpdateKV) -> None:
        self.max_batch = max_batch
        self.update_kv = update_kv

    def speculate(self, speculation: Speculation | None) -> str | None:
        """Draft from ``speculation.index`` in the next ``generate`` calls (models/engines/speculative.py), or
        stop (None). Returns why it cannot (the padded cache has no verification step), else None."""
        if speculation is not None and self.kv_cache != "slots":
            self._speculation = None
            return "the embedded engine verifies drafts on its slot cache, which does not serve this model"
        self._speculation = speculation
        return None

    def close(self) -> None:
        pass  # nothing outside this process: the model and its caches go with the object

    def load_weights(self, checkpoint_dir: str, policy_version: int) -> float:
        state = load_state_dict(checkpoint_dir, self.device)  # read before pausing: only the copy blocks serving
        paused = time.perf_counter()
        assign_weights(self.model, state)
        self.policy_version = policy_version
        return time.perf_counter() - paused

    def _new_cache(self):
        if self.kv_cache == "slots":
            return SlotCache(self.model, self.max_batch, self.pad_token_id)
        return PaddedCache(self.model, self.pad_token_id)

    # -- decoding ------------------------------------------------------------------------------

    def generate(
        self,
        groups: Iterable[GroupRequest],
        should_stop: Callable[[], bool] | None = None,
        update: WeightUpdate | None = None,
    ) -> Iterator[GeneratedSample]:
        feed = iter(groups)
        waiting: list[_Sequence] = []  # sequences of pulled groups not yet admitted

        def pull(slots: int) -> list[_Sequence]:
            while len(waiting) < slots:
                group = next(feed, None)
                if group is None:
                    break
                group.check()
                if group.sampling.stop and self.decode is None:
                    raise ValueError(f"group {group.group_id} has stop strings but this engine was given no decode")
                waiting.extend(_Sequence.of(group, i) for i in group.sample_indices())
            admitted, waiting[:] = waiting[:slots], waiting[slots:]
            return admitted

        finished = 0
        cache = self._new_cache()
        speculation = self._speculation if isinstance(cache, SlotCache) else None
        seqs: list[_Sequence] = []  # the live rows, in the cache's row order
        last = None  # [A] each live row's last token, fed by the next plain decode step
        drafts: list[list[int]] = []  # per live row: the tokens drafted to verify with its last one
        with torch.inference_mode():
            while True:
                if should_stop is not None and should_stop():
                    now = time.time()
                    for s in seqs + waiting:
                        yield s.sample(ABORT, now)
                    return
                recomputed = None
                if update is not None and update.due(finished):
                    directory, version = update.take()
                    recomputed = self._swap(cache, seqs, directory, version, update)
                    update = None
                emitted: list[list[tuple[int, float]]] = []  # per live row: (token, logprob) in order
                if recomputed is not None:
                    emitted = _pairs(*sample_tokens(recomputed, seqs, self.stop_token_ids))
                elif seqs and any(drafts):
                    emitted = self._verify(cache, seqs, drafts)
                    self.decode_steps += 1
                elif seqs:
                    logits = cache.step(last)  # feed the tokens sampled last step; fresh logits for all rows
                    self.decode_steps += 1
                    emitted = _pairs(*sample_tokens(logits, seqs, self.stop_token_ids))
                if len(seqs) <= self.max_batch // 2:  # refill once half the rows are free: one prefill a wave
                    admitted = pull(self.max_batch - len(seqs))
                    if admitted and seqs and (order := cache.sort_rows()) is not None:
                        seqs, emitted = [seqs[i] for i in order], [emitted[i] for i in order]  # longest first again
                    if admitted:
                        joined = self._admit(cache, admitted)
                        emitted += _pairs(*sample_tokens(joined, admitted, self.stop_token_ids))
                        seqs = seqs + admitted
                if not seqs:
                    return
                now = time.time()
                keep: list[int] = []
                for row, s in enumerate(seqs):
                    reason = None
                    new = emitted[row]
                    for token, logprob in new:
                        s.tokens.append(token)
                        s.logprobs.append(logprob)
                        s.versions.append(self.policy_version)
                        stop = not s.group.sampling.ignore_eos and (
                            token in self.stop_token_ids or self._stop_string(s)
                        )
                        if stop or len(s.tokens) >= s.group.sampling.max_tokens:
                            reason = "stop" if stop else "length"
                            break
                    if reason is None:
                        keep.append(row)
                        if speculation is not None:
                            s.follow = follow_on(s.follow, [token for token, _ in new])
                        continue
                    finished += 1
                    if speculation is not None:
                        # its siblings draft from it; by context only the history (indexing every finished
                        # sample's contexts cost more of the round than it saved: docs/engines.md)
                        speculation.index.add(s.group.prompt_token_ids, s.tokens, s.logprobs, contexts=False)
                    yield s.sample(reason, now)
                if len(keep) < len(seqs):
                    order = cache.retire(keep)
                    seqs = [seqs[i] for i in order]
                last = torch.tensor([s.tokens[-1] for s in seqs], device=self.device)
                drafts = self._drafts(seqs, speculation) if speculation is not None else []

    def _drafts(self, seqs: list[_Sequence], speculation: Speculation) -> list[list[int]]:
        """Each live row's draft for the next step: up to ``k`` tokens of its reference, fewer where the sample
        has less room, none once the step's ``step_tokens`` are spent (rows first, in row order)."""
        began = time.perf_counter()
        room = speculation.step_tokens - len(seqs)
        drafts: list[list[int]] = []
        for s in seqs:
            if room <= 0:
                drafts.append([])
                continue
            if s.follow is None:
                s.follow = speculation.index.find(s.group.prompt_token_ids, s.tokens)
            take = min(
                speculation.k, s.draft_len or speculation.k, room, s.group.sampling.max_tokens - len(s.tokens) - 1
            )
            draft = s.follow.draft(take, speculation.min_probability) if s.follow and take > 0 else []
            room -= len(draft)
            drafts.append(draft)
        self.speculation_stats.draft_s += time.perf_counter() - began
        return drafts

    def _verify(self, cache: SlotCache, seqs: list[_Sequence], drafts: list[list[int]]):
        """One decode step feeding each row its last token and its draft; per row the tokens it emits: the
        drafts that are plain sampling's own draws, then plain sampling's draw at the first that is not (or
        after the last). Rolls the cache back past the rejected drafts (models/engines/speculative.py)."""
        counts = [1 + len(d) for d in drafts]
        packed = [token for s, d in zip(seqs, drafts) for token in (s.tokens[-1], *d)]  # a row's last, then its draft
        rows = [row for row, c in enumerate(counts) for _ in range(c)]
        steps = [j for c in counts for j in range(c)]
        logits = cache.verify(
            torch.tensor(packed, device=self.device),
            torch.tensor(rows, device=self.device),
            torch.tensor(steps, device=self.device),
        )
        tokens, logprobs = sample_tokens(logits, [seqs[row] for row in rows], self.stop_token_ids, steps)
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        emitted: list[list[tuple[int, float]]] = []
        stats = self.speculation_stats
        at = 0
        for s, d in zip(seqs, drafts):
            draws = tokens[at : at + len(d) + 1]
            out = list(zip(speculative.accepted_tokens(draws, d), logprobs[at : at + len(d) + 1]))
            if d:
                # the next draft: as long as what was accepted, plus one; twice as long after a full acceptance
                s.draft_len = len(out) if len(out) <= len(d) else 2 * len(d)
                stats.drafting_rows += 1
                stats.drafted += len(d)
                stats.accepted += len(out) - 1
                stats.emitted += len(out)
            emitted.append(out)
            at += len(d) + 1
        stats.verify_steps += 1
        cache.advance(torch.tensor([len(out) for out in emitted], device=self.device))
        return emitted

    def _stop_string(self, s: _Sequence) -> bool:
        """Whether the token just sampled completed one of the request's stop strings. Only the tail is decoded:
        enough tokens for the longest string even at one byte a token (earlier steps checked the rest)."""
        stop = s.group.sampling.stop
        if not stop:
            return False
        tail = self.decode(s.tokens[-(4 * max(map(len, stop)) + 4) :])
        return any(text in tail for text in stop)

    def _swap(self, cache, seqs: list[_Sequence], directory: str, version: int, update: WeightUpdate):
        """Load ``version`` between two decode steps; with ``recompute``, prefill the sequences in flight
        again under it and return their next-token logits (the caller skips a decode step), else None."""
        state = load_state_dict(directory, self.device)  # read before pausing: only the copy and the recompute block
        paused = time.perf_counter()
        assign_weights(self.model, state)
        self.policy_version = version
        logits = None
        if self.update_kv == "recompute" and seqs:
            now = time.time()
            for s in seqs:  # the segment so far counts as generation time; _admit starts the next
                s.gen_s += now - s.segment_at
            cache.clear()
            logits = self._admit(cache, seqs)
        update.applied(time.perf_counter() - paused)
        return logits

    def _admit(self, cache, seqs: list[_Sequence]) -> torch.Tensor:
        """Prefill prompt (+ the prefix of a resumed sample) of each sequence; logits [n, V] for its next token.

        A group's fresh samples share their whole input, so each distinct input runs once and its
        keys, values and logits are copied to one row per sequence: an n-sample group pays one
        prompt's prefill, not n."""
        now = time.time()
        seqs.sort(key=lambda s: -(len(s.group.prompt_token_ids) + len(s.tokens)))  # longest first: see attention_runs
        for s in seqs:
            s.started_at = s.started_at or now
            s.segment_at = now
        inputs, owner = distinct_inputs([(*s.group.prompt_token_ids, *s.tokens) for s in seqs])
        width = max(len(s.group.prompt_token_ids) + s.group.sampling.max_tokens for s in seqs)
        return cache.admit(inputs, owner, width)


def sample_tokens(
    logits: torch.Tensor,
    seqs: list[_Sequence],
    stop_token_ids: int | Iterable[int],
    ahead: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return it and its logprob under the distribution it was drawn from.
    ``ahead``: per row, how many tokens past the sample's generated ones the row's position is (verification:
    the drafts before it); none: 0.

    logits: [B, V] float32. Each row uses its own temperature and top-p. Gumbel-max on the processed
    logits is an exact sample of softmax(processed logits); its noise is a hash of (sample seed, token
    position, vocabulary index), so a sample does not depend on which rows shared its batch.
    Temperature 0 is greedy and reports the logprob under the unscaled distribution. The noise is integer
    arithmetic, the same on every device, so a seed draws the same sample from the same logits anywhere.
    """
    device = logits.device
    temps = torch.tensor([s.group.sampling.temperature for s in seqs], dtype=logits.dtype, device=device)
    top_ps = torch.tensor([s.group.sampling.top_p for s in seqs], dtype=logits.dtype, device=device)
    ignore = [row for row, s in enumerate(seqs) if s.group.sampling.ignore_eos]
    if ignore:  # benchmarks: never sample a stop token when it is ignored
        stops = [stop_token_ids] if isinstance(stop_token_ids, int) else sorted(stop_token_ids)
        logits[torch.tensor(ignore, device=device).unsqueeze(-1), torch.tensor(stops, device=device)] = float("-inf")
    greedy = temps == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(-1)  # [B, V]
    if bool((top_ps < 1).any()):
        scaled = _top_p_filter(scaled, top_ps)
    logp = torch.log_softmax(scaled, dim=-1)  # [B, V]
    seeds = torch.tensor([s.seed for s in seqs], dtype=torch.int64, device=device)
    positions = [len(s.tokens) for s in seqs]
    if ahead is not None:
        positions = [p + a for p, a in zip(positions, ahead)]
    positions = torch.tensor(positions, dtype=torch.int64, device=device)
    noise = counter_uniform(seeds, positions, logits.shape[-1])  # [B, V]
    gumbel = -torch.log(-torch.log(noise))
    sampled = torch.where(greedy, scaled.argmax(-1), (logp + gumbel).argmax(-1))  # [B]
    return sampled, logp.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)


def _pairs(tokens: torch.Tensor, logprobs: torch.Tensor) -> list[list[tuple[int, float]]]:
    """One (token, logprob) a row, as the emission loop takes them."""
    return [[pair] for pair in zip(tokens.tolist(), logprobs.tolist())]


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) noise [B, V] on the device of ``seeds`` [B] from a splitmix64 hash of (seed, position,
    index): stateless and vectorised, so no per-row generator is needed. Integer overflow wraps, as the hash intends."""
    index = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    x = (seeds * _GOLDEN + positions * _MIX1).unsqueeze(-1) + index * _MIX2  # [B, V]
    for shift, mult in ((30, _MIX1), (27, _MIX2)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mult
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    mantissa = (x >> 11) & ((1 << 53) - 1)  # 53 random bits -> a double in [0, 1)
    return ((mantissa.to(torch.float64) + 0.5) * 2.0**-53).to(torch.float32).clamp(1e-12, 1 - 1e-7)


def _top_p_filter(scaled: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (per row); mask the rest."""
    return scaled.masked_fill(nucleus_drop(scaled, top_ps.unsqueeze(-1)), float("-inf"))
