"""Engine construction and the process-wide serving engine that rounds publish weights into.

A campaign keeps one rollout engine alive across rounds: publishing a checkpoint loads its weights
into that engine in place (no restart), which is what ``publish/engine_pause_s`` measures.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_serving: dict[tuple[str, str], Any] = {}


def make_engine(kind: str, local_dir: str, dtype: str, policy_version: int, max_batch: int = 1024) -> tuple[Any, Any]:
    """A fresh engine over a local checkpoint directory, and its tokenizer."""
    if kind != "embedded":
        raise ValueError(f"unknown engine {kind!r}; use 'embedded'")
    from models.engine import EmbeddedEngine
    from models.policy import load_policy

    model, tokenizer = load_policy(local_dir, dtype=dtype)
    return EmbeddedEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_batch, policy_version), tokenizer


def serving_engine(kind: str, local_dir: str, dtype: str, policy_version: int, max_batch: int = 1024) -> tuple[Any, Any, float]:
    """The live engine for (kind, dtype), serving ``policy_version``; returns (engine, tokenizer, pause_s).

    A new engine is built the first time; afterwards new weights are loaded in place and the seconds
    the engine could not serve are returned (0 when it already served this version).
    """
    with _lock:
        entry = _serving.get((kind, dtype))
        if entry is None:
            engine, tokenizer = make_engine(kind, local_dir, dtype, policy_version, max_batch)
            _serving[(kind, dtype)] = (engine, tokenizer, local_dir)
            return engine, tokenizer, 0.0
        engine, tokenizer, served_dir = entry
        engine.max_batch = max_batch
        if engine.policy_version == policy_version and served_dir == local_dir:
            return engine, tokenizer, 0.0
        pause = engine.load_weights(local_dir, policy_version)
        _serving[(kind, dtype)] = (engine, tokenizer, local_dir)
        return engine, tokenizer, pause


def drop_serving_engines() -> None:
    with _lock:
        _serving.clear()
