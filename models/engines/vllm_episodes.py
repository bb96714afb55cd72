"""Multi-turn episodes on the vLLM engine (models/engines/episodes.py has the interface and the why).

Each turn is one vLLM request whose prompt is token ids, never text: the episode's prompt and its sequence so far
(the turns as sampled, the observations as appended), given as ``prompt_token_ids``. What comes back is the ids
vLLM sampled, their logprobs and the weight version of each, kept as they are.

KV kept between turns is vLLM's automatic prefix cache: a finished request leaves its full KV blocks (prompt and
generated tokens alike) in the cache, keyed by the tokens they hold, so the next turn's request, whose prompt
begins with those tokens, finds them and prefills only from the first block they do not fill (the turn's last
sampled token, never fed, the observation, and what was left of a partial block). vLLM reports per request how many
prompt tokens it found cached (``RequestOutput.num_cached_tokens``): those are the session's reused tokens, the
rest its prefill. A block can be evicted while its episode waits on a tool (the cache is shared, least recently
used first out), and then that much is prefilled again: the same tokens, more prefill. ``keep_kv=False`` asks
every request to skip the cache (``skip_reading_prefix_cache``), prefilling the whole sequence each turn; an engine
started without prefix caching keeps nothing (``keeps_kv`` False either way).

A turn's sampling seed is a function of (episode seed, turn): vLLM's per-request generator cannot be keyed by
position as the embedded engine's noise is, so each turn is its own seeded request. A replay of the same episode
(the same prompt, turns and observations) samples the same tokens; the draws are not the embedded engine's.

An episode waiting on its environment has no request in the engine, so it holds no decode slot and no KV blocks
beyond the cached ones; ``step`` adds queued turns while fewer than ``max_live`` are running, then runs one engine
step (``LLMEngine.step``: a decode of every running request, and the prefill of those joining).
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from models.engines.episodes import EpisodeStart, PolicyTurn, SessionStats
from models.engines.types import sample_seed
from models.engines.vllm_engine import FINISH_REASONS, VLLMEngine, token_versions


def turn_seed(seed: int, turn: int) -> int:
    """The seed of an episode's turn ``turn`` (0: the episode's own seed, so turn 0 is ``generate``'s sample for a
    group of one with the episode's id)."""
    if turn == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}#turn{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class _Episode:
    start: EpisodeStart
    seed: int
    tokens: list[int] = field(default_factory=list)  # the sequence after the prompt: turns and observations
    turn: int = 0
    turn_max: int = 0  # the most tokens of the current turn
    turn_started_at: float = 0.0
    policy_version: int = 0  # the version served when the turn's request was added
    request_id: str = ""
    prompt_tokens: int = 0  # the current turn's request's prompt: the episode's prompt and sequence so far
    state: str = "queued"  # queued | decoding | waiting (its turn ended; the environment answers) | ended


class VLLMEpisodes:
    """An ``EpisodeSession`` on a ``VLLMEngine`` (module doc)."""

    def __init__(self, engine: VLLMEngine, *, max_live: int, keep_kv: bool = True) -> None:
        self.engine = engine
        self.max_live = max_live
        caching = engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        self.keeps_kv = keep_kv and bool(caching)
        self.stats = SessionStats()
        self._episodes: dict[str, _Episode] = {}
        self._queue: deque[_Episode] = deque()
        self._running: dict[str, _Episode] = {}  # request id -> the episode whose turn it samples

    # -- the caller's side -------------------------------------------------------------------------

    def start(self, episode: EpisodeStart) -> None:
        if episode.episode_id in self._episodes:
            raise ValueError(f"episode {episode.episode_id} was already started in this session")
        ep = _Episode(episode, sample_seed(episode.sampling.seed, episode.episode_id, 0))
        ep.turn_max = episode.sampling.max_tokens
        self._episodes[episode.episode_id] = ep
        self._queue.append(ep)

    def extend(self, episode_id: str, observation_token_ids: Sequence[int], *, max_tokens: int | None = None) -> None:
        ep = self._episodes[episode_id]
        if ep.state != "waiting":
            raise ValueError(f"episode {episode_id} is {ep.state}: only an episode whose turn ended can be extended")
        ep.turn_max = min(max_tokens or ep.start.sampling.max_tokens, ep.start.sampling.max_tokens)
        ep.tokens.extend(int(t) for t in observation_token_ids)
        ep.turn += 1
        ep.state = "queued"
        self._queue.append(ep)

    def end(self, episode_id: str) -> None:
        """Nothing is held for a waiting episode but cached blocks, which vLLM evicts as it needs room."""
        ep = self._episodes[episode_id]
        if ep.state in ("decoding", "queued"):
            raise ValueError(f"episode {episode_id} is {ep.state}; end it after its turn ends")
        ep.state = "ended"

    @property
    def busy(self) -> bool:
        return bool(self._running or self._queue)

    def sequence(self, episode_id: str) -> list[int]:
        return list(self._episodes[episode_id].tokens)

    # -- one step ----------------------------------------------------------------------------------

    def step(self) -> list[PolicyTurn]:
        engine = self.engine.llm.llm_engine
        while self._queue and len(self._running) < self.max_live:
            self._admit(engine, self._queue.popleft())
        if not self._running:
            return []
        self.stats.decode_steps += 1
        self.engine.decode_steps += 1
        ended = []
        for out in engine.step():
            ep = self._running.get(out.request_id)
            if ep is not None and out.finished:
                del self._running[out.request_id]
                ended.append(self._turn(ep, out))
        return ended

    def _admit(self, engine, ep: _Episode) -> None:
        prompt = [*ep.start.prompt_token_ids, *ep.tokens]
        params = self.engine.request_params(
            ep.start.sampling, seed=turn_seed(ep.seed, ep.turn), max_tokens=ep.turn_max, read_cache=self.keeps_kv
        )
        ep.request_id = self.engine.request_id(f"episode/{ep.start.episode_id}/{ep.turn}")
        ep.prompt_tokens = len(prompt)
        ep.policy_version = self.engine.policy_version
        ep.turn_started_at = time.time()
        ep.state = "decoding"
        engine.add_request(ep.request_id, {"prompt_token_ids": prompt}, params)
        self._running[ep.request_id] = ep

    def _turn(self, ep: _Episode, out) -> PolicyTurn:
        """The finished request as the episode's turn: its ids, logprobs and versions as vLLM returned them."""
        completion = out.outputs[0]
        tokens = [int(t) for t in completion.token_ids]
        entries = completion.logprobs or []
        logprobs = [float(entries[i][t].logprob) for i, t in enumerate(tokens)]
        versions = token_versions(completion.weight_versions, len(tokens), ep.policy_version)
        if completion.finish_reason not in FINISH_REASONS:
            raise RuntimeError(
                f"vLLM ended turn {ep.turn} of episode {ep.start.episode_id} with {completion.finish_reason!r}, "
                "not stop or length: a session's requests are never aborted, so the engine failed it"
            )
        reused = min(int(out.num_cached_tokens or 0), ep.prompt_tokens)  # None: vLLM reported no prefill stats
        prefill = ep.prompt_tokens - reused
        key = ep.start.episode_id
        self.stats.prefill_tokens += prefill
        self.stats.reused_tokens += reused
        self.stats.per_episode_prefill[key] = self.stats.per_episode_prefill.get(key, 0) + prefill
        self.stats.turns += 1
        start = len(ep.tokens)
        ep.tokens.extend(tokens)
        ep.state = "waiting"
        return PolicyTurn(
            episode_id=key,
            turn=ep.turn,
            start=start,
            token_ids=tokens,
            logprobs=logprobs,
            policy_versions=versions,
            finish_reason=completion.finish_reason,
            prefill_tokens=prefill,
            started_at=ep.turn_started_at,
            finished_at=time.time(),
        )
