"""An episode session on whichever engine a round serves (models/engines/episodes.py has the interface)."""

from __future__ import annotations

from models.engines.embedded import EmbeddedEngine
from models.engines.embedded_episodes import EmbeddedEpisodes
from models.engines.episodes import EpisodeSession


def open_session(engine, *, max_live: int, keep_kv: bool = True) -> EpisodeSession:
    """A session of at most ``max_live`` episodes decoding at once on ``engine``, keeping each episode's KV cache
    between its turns where the engine can."""
    if isinstance(engine, EmbeddedEngine):
        return EmbeddedEpisodes(engine, max_live=max_live, keep_kv=keep_kv)
    raise ValueError(
        f"multi-turn episodes (round.environment) run on the embedded engine; {type(engine).__name__} has no "
        "episode session"
    )
