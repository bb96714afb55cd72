"""Opening an episode session on any engine (models/engines/episodes.py), and the session over a replica set.

    session = open_session(engine, max_live=32)     # EmbeddedEpisodes | VLLMEpisodes | ReplicaEpisodes

``ReplicaEpisodes`` runs episodes on the Ray replicas of a ``ReplicaRouter`` (models/engines/replicas.py). Each
episode is assigned to one replica when it starts, the one with the fewest unfinished episodes (ties broken by a
hash of the episode id, so an assignment does not depend on the process), and every later turn of it goes there:
that replica's engine holds what is kept of its sequence (the embedded engine's kept KV, vLLM's prefix cache), which
no other replica has. Each replica runs a local session of its own engine's kind (``open_session`` on the actor).

The caller's ``start`` and ``extend`` are queued here and sent with the next ``step`` to their replica; ``step`` then
steps every replica that has work, in parallel (one actor call each: its commands, then one step of its session),
and returns the turns that ended on any of them, each labelled with its replica by the replica itself. ``end`` is
sent at once: the replica drops what it kept without waiting for a step that may never come. The session keeps
each episode's sequence itself (from the turns and observations that pass through it), so ``sequence`` asks no
replica.

On the embedded engine an episode's tokens do not depend on its replica (its noise is keyed by its seed and
position), so a replica set gives the tokens one engine gives; on vLLM the same holds for each turn's seeded
request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from models.engines.embedded import EmbeddedEngine
from models.engines.embedded_episodes import EmbeddedEpisodes
from models.engines.episodes import EpisodeSession, EpisodeStart, PolicyTurn, SessionStats
from models.engines.replicas import EpisodeExtend, ReplicaRouter
from models.engines.types import RolloutEngine
from models.engines.vllm_engine import VLLMEngine
from models.engines.vllm_episodes import VLLMEpisodes


def open_session(engine: RolloutEngine, *, max_live: int, keep_kv: bool = True) -> EpisodeSession:
    """The episode session for ``engine``'s kind: at most ``max_live`` episodes decoding at once (on each replica,
    for a replica set); ``keep_kv`` False prefills each turn's whole sequence again."""
    if isinstance(engine, EmbeddedEngine):
        return EmbeddedEpisodes(engine, max_live=max_live, keep_kv=keep_kv)
    if isinstance(engine, VLLMEngine):
        return VLLMEpisodes(engine, max_live=max_live, keep_kv=keep_kv)
    if isinstance(engine, ReplicaRouter):
        return ReplicaEpisodes(engine, max_live=max_live, keep_kv=keep_kv)
    raise TypeError(f"no episode session for a {type(engine).__name__}; use the embedded or vllm engine")


def replica_of_episode(episode_id: str, candidates: Sequence[int]) -> int:
    """One of ``candidates`` (replicas equally loaded), chosen by a stable hash of the episode id."""
    digest = hashlib.blake2b(episode_id.encode(), digest_size=8).digest()
    return candidates[int.from_bytes(digest, "little") % len(candidates)]


class ReplicaEpisodes:
    """An ``EpisodeSession`` over a replica set, each episode on one replica (module doc)."""

    def __init__(self, router: ReplicaRouter, *, max_live: int, keep_kv: bool = True) -> None:
        import ray  # Ray only where engines run on it: importing it takes seconds

        self.router = router
        opened = [a.open_episodes.remote(open_session, r, max_live, keep_kv) for r, a in enumerate(router.actors)]
        self.keeps_kv = all(ray.get(opened))
        self.stats = SessionStats()
        self.assigned: dict[str, int] = {}
        """Episode id -> the replica that runs all its turns."""
        self._replica_stats = [SessionStats() for _ in router.actors]
        self._pending: list[list[EpisodeStart | EpisodeExtend]] = [[] for _ in router.actors]
        self._busy = [False] * len(router.actors)
        self._live = [0] * len(router.actors)  # unfinished episodes per replica: the load an assignment balances
        self._sequences: dict[str, list[int]] = {}
        self._state: dict[str, str] = {}  # queued | waiting | ended, as the local sessions keep it
        self._ends: list = []  # end calls sent, checked at the next step

    # -- the caller's side -------------------------------------------------------------------------

    def start(self, episode: EpisodeStart) -> None:
        key = episode.episode_id
        if key in self.assigned:
            raise ValueError(f"episode {key} was already started in this session")
        least = min(self._live)
        replica = replica_of_episode(key, [r for r, n in enumerate(self._live) if n == least])
        self.assigned[key] = replica
        self._live[replica] += 1
        self._sequences[key] = []
        self._state[key] = "queued"
        self._pending[replica].append(episode)

    def extend(self, episode_id: str, observation_token_ids: Sequence[int], *, max_tokens: int | None = None) -> None:
        state = self._state[episode_id]
        if state != "waiting":
            raise ValueError(f"episode {episode_id} is {state}: only an episode whose turn ended can be extended")
        ids = tuple(int(t) for t in observation_token_ids)
        self._sequences[episode_id].extend(ids)
        self._state[episode_id] = "queued"
        self._pending[self.assigned[episode_id]].append(EpisodeExtend(episode_id, ids, max_tokens))

    def end(self, episode_id: str) -> None:
        state = self._state[episode_id]
        if state == "queued":
            raise ValueError(f"episode {episode_id} is {state}; end it after its turn ends")
        if state == "ended":
            return
        replica = self.assigned[episode_id]
        self._state[episode_id] = "ended"
        self._live[replica] -= 1
        self._ends.append(self.router.actors[replica].episode_end.remote(episode_id))

    @property
    def busy(self) -> bool:
        return any(self._busy) or any(self._pending)

    def sequence(self, episode_id: str) -> list[int]:
        return list(self._sequences[episode_id])

    # -- one step ----------------------------------------------------------------------------------

    def step(self) -> list[PolicyTurn]:
        import ray  # Ray only where engines run on it: importing it takes seconds

        working = [r for r in range(len(self._busy)) if self._busy[r] or self._pending[r]]
        calls = [self.router.actors[r].episode_step.remote(self._pending[r]) for r in working]
        for r in working:
            self._pending[r] = []
        results = ray.get(calls)
        if self._ends:
            ray.get(self._ends)  # long done: an end that failed is raised here
            self._ends = []
        ended: list[PolicyTurn] = []
        for r, (turns, busy, stats) in zip(working, results):
            self._busy[r] = busy
            self._replica_stats[r] = stats
            for turn in turns:
                self._sequences[turn.episode_id].extend(turn.token_ids)
                self._state[turn.episode_id] = "waiting"
            ended += turns
        self._merge_stats()
        return ended

    def _merge_stats(self) -> None:
        """The session's stats: every replica's, summed (their decode steps too, though they run side by side)."""
        each = self._replica_stats
        self.stats = SessionStats(
            prefill_tokens=sum(s.prefill_tokens for s in each),
            reused_tokens=sum(s.reused_tokens for s in each),
            decode_steps=sum(s.decode_steps for s in each),
            turns=sum(s.turns for s in each),
            per_episode_prefill={k: v for s in each for k, v in s.per_episode_prefill.items()},
        )
