"""Multi-turn episodes on an engine: the policy's turns interleaved with the environment's observations, token in,
token out, with each episode's KV cache kept between its turns.

An episode is one growing token sequence: the prompt, then the policy's first turn, then an observation, then the
policy's next turn, and so on. The engine never sees text: what the policy sampled is kept as the ids it sampled
(never decoded and encoded again, which need not give the same ids back), and an observation is appended as the
ids the caller encoded it to. So the sequence the trainer scores is exactly the sequence that was sampled.

A session (``EpisodeSession``) is opened on an engine and driven by the caller one step at a time.
``open_session(engine, max_live=..., keep_kv=...)`` (models/engines/sessions.py) opens the one for the engine's
kind: ``EmbeddedEpisodes`` (models/engines/embedded_episodes.py), ``VLLMEpisodes`` (models/engines/vllm_episodes.py)
or, over Ray replicas, ``ReplicaEpisodes``, which keeps each episode on one replica:

    session.start(EpisodeStart(...))           # queue a new episode (its prompt)
    session.extend(episode_id, observation)    # queue its next turn: the observation's ids are appended
    turns = session.step()                     # admit what is queued, run one decode step for every episode
                                               # decoding; returns the policy turns that ended in this step
    session.end(episode_id)                    # the episode is over: drop what the engine keeps of it

A turn ends at a stop token (``EmbeddedEngine``'s end-of-sequence ids), a stop string of its ``SamplingParams``
(``</tool_call>``, say) or its ``max_tokens``. Between ``step`` calls the caller runs the environment: episodes
waiting on their tools hold no row of the decode batch, so the others keep decoding while tools run.

KV kept between turns (``keep_kv=True``). On the embedded engine's slot cache: when a turn ends, the keys and
values of the episode's sequence are set aside; ``extend`` puts them back and prefills only the new tokens (the
turn's last sampled token, not yet fed, and the observation) as an append onto them. On vLLM, its prefix cache keeps
them (models/engines/vllm_episodes.py). ``keep_kv=False`` prefills the whole sequence again each turn: the same
tokens and logprobs (to float rounding), far more prefill. ``SessionStats`` counts both.

Sampling noise is a function of (episode seed, position in the sequence, vocabulary index), as for single-turn
samples (models/engines/embedded.py ``sample_tokens``), so an episode replays the same whatever else shared its
batch and however long its tools took. (vLLM: each turn's request is seeded by (episode seed, turn), with the
same consequence.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from models.engines.types import SamplingParams


@dataclass(frozen=True, kw_only=True)
class EpisodeStart:
    """A new episode: its id (unique within the session; it seeds the sampling noise), its prompt's ids, and how
    each of its turns is sampled (``max_tokens``: the most tokens of one turn; ``stop``: strings ending a turn)."""

    episode_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams


@dataclass(kw_only=True)
class PolicyTurn:
    """One turn the policy took: the ids it sampled, as sampled, with their behaviour logprobs and policy versions."""

    episode_id: str
    turn: int
    """0 for the turn after the prompt, 1 after the first observation, ..."""
    start: int
    """Where the turn's first token sits in the episode's sequence (counted from the first token after the prompt)."""
    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: str
    """stop (a stop token or string) | length (the turn's max_tokens)."""
    prefill_tokens: int
    """Tokens prefilled to begin this turn: the prompt (turn 0), the appended tokens (KV kept), or the whole
    sequence so far (KV not kept)."""
    started_at: float
    finished_at: float
    replica: int | None = None
    """The replica (of a replica set, models/engines/sessions.py) whose engine sampled the turn; None: one engine."""


@dataclass
class SessionStats:
    prefill_tokens: int = 0
    """Tokens run through prefill (prompts, appends, re-prefills), summed over the session."""
    reused_tokens: int = 0
    """Tokens whose keys and values were kept from an earlier turn instead of prefilled again."""
    decode_steps: int = 0
    turns: int = 0
    per_episode_prefill: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class EpisodeSession(Protocol):
    """One set of episodes in flight on an engine (the module doc)."""

    stats: SessionStats
    keeps_kv: bool
    """Whether ``extend`` appends onto the kept KV cache (True) or prefills the whole sequence again (False)."""

    def start(self, episode: EpisodeStart) -> None:
        """Queue a new episode; its first turn begins at a later ``step``."""
        ...

    def extend(self, episode_id: str, observation_token_ids: Sequence[int], *, max_tokens: int | None = None) -> None:
        """Queue the episode's next turn after its last one ended: ``observation_token_ids`` are appended as given
        (the environment's answer, and whatever the chat format puts before the policy speaks again).
        ``max_tokens``: this turn's limit, if lower than the episode's (what is left of a token budget)."""
        ...

    def end(self, episode_id: str) -> None:
        """The episode is over (or abandoned): drop its kept cache; its id may not be extended again."""
        ...

    def step(self) -> list[PolicyTurn]:
        """Admit queued turns where there is room, run one decode step; the turns that ended in it."""
        ...

    @property
    def busy(self) -> bool:
        """Whether a ``step`` has anything to do (an episode decoding, or a turn queued)."""
        ...

    def sequence(self, episode_id: str) -> list[int]:
        """The episode's ids after its prompt so far: every turn's and every observation's, in order."""
        ...
