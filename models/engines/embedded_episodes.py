"""Multi-turn episodes on the embedded engine (models/engines/episodes.py has the interface and the why).

``EpisodeSlotCache`` adds two calls to the slot cache (models/engines/kv_cache.py):

    save(row)                       -> KeptKV        the row's keys and values, set aside when its turn ends
    restore(kept, tails, width)     -> logits [n, V] kept rows back into slots A..A+n-1, each extended by its
                                                     tail (the tokens after what was kept) in one append pass

The append attends each new token over the row's kept keys and the tail's earlier tokens, the same attention a
prefill of the whole sequence computes for those positions, so the next token's distribution is the same (to
float rounding) while only the tail is computed.

``EmbeddedEpisodes`` is the session: the engine's decode loop (models/engines/embedded.py) turned inside out, one
``step`` per call, with turns instead of samples. Only the slot cache keeps KV between turns; on a model it cannot
serve (``kv_cache='padded'``) a session prefills the whole sequence each turn (``keeps_kv`` False).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from models.engines.embedded import EmbeddedEngine, _pairs, sample_tokens
from models.engines.episodes import EpisodeStart, PolicyTurn, SessionStats
from models.engines.kv_cache import PaddedCache, SlotCache, distinct_inputs, slot_cache_applies
from models.engines.types import GroupRequest, sample_seed


@dataclass
class KeptKV:
    """One sequence's keys and values set aside between turns: per layer [length, kv_heads, head_dim]."""

    length: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class EpisodeSlotCache(SlotCache):
    """The slot cache, plus setting a row aside and bringing it back extended (module doc)."""

    def save(self, row: int) -> KeptKV:
        length = int(self.lengths[row])
        return KeptKV(
            length,
            [k[row, :length].clone() for k in self.keys],
            [v[row, :length].clone() for v in self.values],
        )

    def restore(self, kept: list[KeptKV], tails: list[Sequence[int]], width: int) -> torch.Tensor:
        """Kept rows into the next free slots, each followed by its tail (>= 1 token); logits [n, V] for each
        row's next token. ``width``: positions to reserve per slot (the longest row after its next turn)."""
        n, first = len(kept), self.live
        if first + n > self.slots:
            raise ValueError(f"{first} live rows + {n} restored exceed {self.slots} slots")
        if any(len(t) == 0 for t in tails):
            raise ValueError("each restored row needs at least one new token to compute its next one from")
        span = max(kv.length + len(t) for kv, t in zip(kept, tails))
        self._reserve(max(width, span))
        for i, kv in enumerate(kept):
            for layer in range(len(self.keys)):
                self.keys[layer][first + i, : kv.length] = kv.keys[layer]
                self.values[layer][first + i, : kv.length] = kv.values[layer]
            self.lengths[first + i] = kv.length
        self.live += n
        return self._append(first, tails)

    def _append(self, first: int, tails: list[Sequence[int]]) -> torch.Tensor:
        """Feed rows first..first+D-1 their tails (right-padded to the longest, T); logits [D, V] after each tail.

        Pad positions write keys past a row's new length; no query of the row sees them (each sees keys up to its
        own position) and the row's next decode step overwrites the first of them."""
        d = len(tails)
        rows = slice(first, first + d)
        counts = torch.tensor([len(t) for t in tails], device=self.device)  # [D]
        fed = int(counts.max())
        base = self.lengths[rows].clone()  # [D] tokens each row holds before its tail
        ids = torch.tensor([[*t, *[self.pad_token_id] * (fed - len(t))] for t in tails], device=self.device)
        positions = base.unsqueeze(-1) + torch.arange(fed, device=self.device)  # [D, T]
        span = int(positions.max()) + 1
        hidden_mask = torch.arange(span, device=self.device) > positions.unsqueeze(-1)  # [D, T, span] True: unseen
        slots = torch.arange(first, first + d, device=self.device).unsqueeze(-1)  # [D, 1]
        at = (slots * self.width + positions).reshape(-1)  # [D*T] flattened slot positions written
        hidden = self.model.model.embed_tokens(ids)  # [D, T, hidden]
        cos = self.cos[positions].unsqueeze(2)  # [D, T, 1, head_dim]
        sin = self.sin[positions].unsqueeze(2)
        for layer, keys, values in zip(self.model.model.layers, self.keys, self.values):
            q, k, v = self._project(layer, hidden, cos, sin)  # [D, T, heads | kv_heads, head_dim]
            keys.view(-1, self.kv_heads, self.head_dim).index_copy_(0, at, k.reshape(-1, self.kv_heads, self.head_dim))
            values.view(-1, self.kv_heads, self.head_dim).index_copy_(
                0, at, v.reshape(-1, self.kv_heads, self.head_dim)
            )
            out = self._attend_many(q, keys[rows, :span], values[rows, :span], hidden_mask)  # [D, T, heads, Dh]
            hidden = self._finish_layer(layer, hidden, out)
        self.lengths[rows] = base + counts
        last = hidden[torch.arange(d, device=self.device), counts - 1]  # [D, hidden]
        return self._logits(last)


@dataclass
class _Episode:
    start: EpisodeStart
    group: GroupRequest  # what sample_tokens reads a row's sampling from
    seed: int
    tokens: list[int] = field(default_factory=list)  # the sequence after the prompt: turns and observations
    turn: int = 0
    turn_start: int = 0
    turn_logprobs: list[float] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    turn_prefill: int = 0
    turn_started_at: float = 0.0
    turn_max: int = 0  # the most tokens of the current turn
    kept: KeptKV | None = None
    state: str = "queued"  # queued | decoding | waiting (its turn ended; the environment answers) | ended

    @property
    def full(self) -> tuple[int, ...]:
        return (*self.start.prompt_token_ids, *self.tokens)


class EmbeddedEpisodes:
    """An ``EpisodeSession`` on an ``EmbeddedEngine`` (models/engines/episodes.py)."""

    def __init__(self, engine: EmbeddedEngine, *, max_live: int, keep_kv: bool = True) -> None:
        self.engine = engine
        self.max_live = max_live
        # the session's own cache holds max_live rows: the slot cache must fit that many, not the engine's max_batch
        positions = getattr(engine.model.config, "max_position_embeddings", None) or 4096
        slots = engine.kv_cache == "slots" and slot_cache_applies(engine.model, max_live, positions) is None
        self.keeps_kv = keep_kv and slots
        if slots:
            self.cache: SlotCache | PaddedCache = EpisodeSlotCache(engine.model, max_live, engine.pad_token_id)
        else:
            self.cache = PaddedCache(engine.model, engine.pad_token_id)
        self.stats = SessionStats()
        self._episodes: dict[str, _Episode] = {}
        self._queue: deque[_Episode] = deque()
        self._rows: list[_Episode] = []  # the decoding episodes, in the cache's row order

    # -- the caller's side -------------------------------------------------------------------------

    def start(self, episode: EpisodeStart) -> None:
        if episode.episode_id in self._episodes:
            raise ValueError(f"episode {episode.episode_id} was already started in this session")
        if episode.sampling.stop and self.engine.decode is None:
            raise ValueError(f"episode {episode.episode_id} has stop strings but the engine was given no decode")
        group = GroupRequest(episode.episode_id, episode.prompt_token_ids, 1, episode.sampling)
        ep = _Episode(episode, group, sample_seed(episode.sampling.seed, episode.episode_id, 0))
        ep.turn_max = episode.sampling.max_tokens
        self._episodes[episode.episode_id] = ep
        self._queue.append(ep)

    def extend(self, episode_id: str, observation_token_ids: Sequence[int], *, max_tokens: int | None = None) -> None:
        ep = self._episodes[episode_id]
        ep.turn_max = min(max_tokens or ep.start.sampling.max_tokens, ep.start.sampling.max_tokens)
        if ep.state != "waiting":
            raise ValueError(f"episode {episode_id} is {ep.state}: only an episode whose turn ended can be extended")
        ep.tokens.extend(int(t) for t in observation_token_ids)
        ep.turn += 1
        ep.state = "queued"
        self._queue.append(ep)

    def end(self, episode_id: str) -> None:
        ep = self._episodes[episode_id]
        if ep.state in ("decoding", "queued"):
            raise ValueError(f"episode {episode_id} is {ep.state}; end it after its turn ends")
        ep.kept = None
        ep.state = "ended"

    @property
    def busy(self) -> bool:
        return bool(self._rows or self._queue)

    def sequence(self, episode_id: str) -> list[int]:
        return list(self._episodes[episode_id].tokens)

    # -- one step ----------------------------------------------------------------------------------

    def step(self) -> list[PolicyTurn]:
        emitted: list[list[tuple[int, float]]] = []
        with torch.inference_mode():
            if self._rows:
                last = torch.tensor([ep.tokens[-1] for ep in self._rows], device=self.engine.device)
                logits = self.cache.step(last)
                self.stats.decode_steps += 1
                emitted = _pairs(*sample_tokens(logits, self._rows, self.engine.stop_token_ids))
            room = self.max_live - len(self._rows)
            if room > 0 and self._queue:
                joining = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
                joined, logits = self._admit(joining)
                emitted += _pairs(*sample_tokens(logits, joined, self.engine.stop_token_ids))
                self._rows += joined
            return self._take(emitted)

    def _admit(self, joining: list[_Episode]) -> tuple[list[_Episode], torch.Tensor]:
        """Prefill the joining episodes' next turns: appended onto their kept KV where it is kept, else the whole
        sequence. Returns them in the order their rows were added, with logits [n, V] for each one's next token."""
        now = time.time()
        restored = [ep for ep in joining if ep.kept is not None]
        fresh = [ep for ep in joining if ep.kept is None]
        parts = []
        if fresh:  # new rows first, then the restored ones after them: the cache adds rows in call order
            inputs, owner = distinct_inputs([ep.full for ep in fresh])
            width = max(len(ep.full) + ep.turn_max for ep in fresh)
            parts.append(self.cache.admit(inputs, owner, width))
            for ep in fresh:
                self._begin(ep, len(ep.full), now)
            self.stats.prefill_tokens += sum(len(x) for x in inputs)
        if restored:
            tails = [ep.full[ep.kept.length :] for ep in restored]
            width = max(len(ep.full) + ep.turn_max for ep in restored)
            parts.append(self.cache.restore([ep.kept for ep in restored], tails, width))
            for ep, tail in zip(restored, tails):
                self.stats.reused_tokens += ep.kept.length
                ep.kept = None
                self._begin(ep, len(tail), now)
                self.stats.prefill_tokens += len(tail)
        return fresh + restored, torch.cat(parts) if len(parts) > 1 else parts[0]

    def _begin(self, ep: _Episode, prefill: int, now: float) -> None:
        ep.state = "decoding"
        ep.turn_start = len(ep.tokens)
        ep.turn_logprobs, ep.turn_versions = [], []
        ep.turn_prefill = prefill
        ep.turn_started_at = now
        key = ep.start.episode_id
        self.stats.per_episode_prefill[key] = self.stats.per_episode_prefill.get(key, 0) + prefill

    def _take(self, emitted: list[list[tuple[int, float]]]) -> list[PolicyTurn]:
        """Append each row's token; the turns that ended leave the batch (their KV set aside if it is kept)."""
        if not self._rows:
            return []
        now = time.time()
        ended: list[PolicyTurn] = []
        keep: list[int] = []
        for row, ep in enumerate(self._rows):
            reason = None
            for token, logprob in emitted[row]:
                ep.tokens.append(token)
                ep.turn_logprobs.append(logprob)
                ep.turn_versions.append(self.engine.policy_version)
                sampling = ep.start.sampling
                if not sampling.ignore_eos and (token in self.engine.stop_token_ids or self._stop_string(ep)):
                    reason = "stop"
                elif len(ep.tokens) - ep.turn_start >= ep.turn_max:
                    reason = "length"
            if reason is None:
                keep.append(row)
                continue
            if self.keeps_kv:
                ep.kept = self.cache.save(row)
            ep.state = "waiting"
            self.stats.turns += 1
            ended.append(
                PolicyTurn(
                    episode_id=ep.start.episode_id,
                    turn=ep.turn,
                    start=ep.turn_start,
                    token_ids=ep.tokens[ep.turn_start :],
                    logprobs=ep.turn_logprobs,
                    policy_versions=ep.turn_versions,
                    finish_reason=reason,
                    prefill_tokens=ep.turn_prefill,
                    started_at=ep.turn_started_at,
                    finished_at=now,
                )
            )
        if len(keep) < len(self._rows):
            order = self.cache.retire(keep)  # order[i]: the old row now at i
            self._rows = [self._rows[i] for i in order]
        return ended

    def _stop_string(self, ep: _Episode) -> bool:
        """Whether the token just sampled completed a stop string of the turn (only the turn's tail is decoded)."""
        stop = ep.start.sampling.stop
        if not stop:
            return False
        turn = ep.tokens[ep.turn_start :]
        tail = self.engine.decode(turn[-(4 * max(map(len, stop)) + 4) :])
        return any(text in tail for text in stop)
