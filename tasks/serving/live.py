"""The engines a campaign keeps serving across its rounds, and the weights a trainer hands over in memory.

A campaign keeps one rollout engine alive across rounds: publishing a checkpoint loads its weights into that
engine in place (no restart), which is what ``publish/engine_pause_s`` measures. What is live is held by one
``LiveEngines`` object, opened by the flow that owns the engines and passed to every stage that generates or
scores (rollout, publish, evaluate, the base's registration, replay):

    with LiveEngines() as engines:          # a campaign, or a round, replay or evaluation run on its own
        run_rollout(..., engines=engines)   # builds the rollout engine the first time
        run_publish(..., engines=engines)   # loads the new weights into it, in place
    # leaving the block closes every engine it built: a long-lived Prefect worker keeps no vLLM engine's memory

Who may touch it: the stages of the flow that opened it, one at a time or from the round's overlapped rollout
(a lock guards the table); nothing else reaches it, since it is passed, never looked up.

Weights from memory. The trainer writes every checkpoint, and may also hand the same weights over in memory
(``offer_weights``): the next load of that checkpoint into an engine that takes weights from memory (vLLM on
GPUs, a ``WeightReceiver``) serves the tensors instead of reading the files. An offer is used once, by the first
engine to load that checkpoint; everything else (a CPU engine, a second engine, a resumed round in a fresh
process) reads the checkpoint as before.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from models.device import engine_dtype, release_cached_memory, resolve_device
from models.engines.types import RolloutEngine, UpdateKV, WeightReceiver
from tasks.serving.engines import Placement, make_engine, served_on_gpu

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

ROLES = ("rollout", "evaluate")
"""A live engine per role: in sync mode evaluation shares the rollout engine (one engine per campaign);
in overlap mode the next round's rollout holds that engine while this round evaluates, so evaluation
has its own."""

_SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


def model_shape(local_dir: str) -> str:
    """What must match for new weights to load into a live engine in place (not the values)."""
    with open(os.path.join(local_dir, "config.json")) as f:
        config = json.load(f)
    return json.dumps({k: config.get(k) for k in _SHAPE_FIELDS}, sort_keys=True)


def takes_weights_from_memory(engine: RolloutEngine) -> bool:
    """Whether ``engine`` serves new weights from the trainer's memory (vLLM on GPUs) rather than a checkpoint."""
    return isinstance(engine, WeightReceiver) and engine.weights_from_memory


@dataclass
class _Live:
    engine: RolloutEngine
    tokenizer: PreTrainedTokenizerBase
    local_dir: str
    placement: Placement


class LiveEngines:
    """The live engines, one per (role, kind, dtype, device, model shape), and at most one offer of weights.

    ``__slots__`` and no ``__dict__``: passed to a Prefect task or subflow, it is recorded as a placeholder, never
    walked into (its engines hold models)."""

    __slots__ = ("_lock", "_live", "_offered", "_closed")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[tuple[str, str, str, str, str], _Live] = {}
        self._offered: dict[str, Mapping[str, torch.Tensor]] = {}  # checkpoint URI -> its weights
        self._closed = False

    def __enter__(self) -> LiveEngines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def serve(
        self,
        kind: str,
        local_dir: str,
        *,
        dtype: str,
        policy_version: int,
        max_batch: int = 1024,
        placement: Placement | None = None,
        role: str = "rollout",
        update_kv: UpdateKV = "recompute",
        weights: Mapping[str, torch.Tensor] | None = None,
        device: str = "auto",
    ) -> tuple[RolloutEngine, PreTrainedTokenizerBase, float]:
        """The live engine for (role, kind, dtype, device), serving ``policy_version``; returns (engine, tokenizer,
        pause_s).

        A new engine is built the first time; afterwards new weights are loaded in place and the seconds the
        engine could not serve are returned (0 when it already served this version). ``placement`` None means
        "wherever the live engine runs" (publish and evaluate); a different explicit placement replaces the live
        engine. ``weights``: the same weights as ``local_dir``'s, in memory (``take_offered``); an engine that takes
        weights from memory serves them, any other reads ``local_dir``.
        """
        if role not in ROLES:
            raise ValueError(f"unknown engine role {role!r}; use one of: {', '.join(ROLES)}")
        placed = str(resolve_device(device))  # 'auto' and 'cuda' name one engine: the device they resolve to
        dtype = engine_dtype(dtype, on_gpu=served_on_gpu(kind, placed))  # 'auto' names one engine too
        key = (role, kind, dtype, placed, model_shape(local_dir))  # another architecture needs its own engine
        with self._lock:
            if self._closed:
                raise RuntimeError("these live engines were closed with the flow that opened them")
            entry = self._live.get(key)
            if entry is not None and placement is not None and entry.placement != placement:
                self._live.pop(key).engine.close()
                entry = None
            if entry is None:
                where = placement or Placement()
                if kind == "vllm":  # an engine closed above, or a trainer's freed tensors: vLLM sizes from free memory
                    release_cached_memory()
                engine, tokenizer = make_engine(
                    kind,
                    local_dir,
                    dtype=dtype,
                    policy_version=policy_version,
                    max_batch=max_batch,
                    placement=where,
                    update_kv=update_kv,
                    device=device,
                )
                self._live[key] = _Live(engine, tokenizer, local_dir, where)
                return engine, tokenizer, 0.0
            entry.engine.configure(max_batch, update_kv)
            if entry.engine.policy_version == policy_version and entry.local_dir == local_dir:
                return entry.engine, entry.tokenizer, 0.0
            if weights is not None and takes_weights_from_memory(entry.engine):
                pause = entry.engine.push_weights(weights, policy_version)
            else:
                pause = entry.engine.load_weights(local_dir, policy_version)
            entry.local_dir = local_dir
            return entry.engine, entry.tokenizer, pause

    def offer_weights(self, checkpoint: str, weights: Mapping[str, torch.Tensor]) -> None:
        """Hand the weights of committed checkpoint ``checkpoint`` (its URI) over in memory: Hugging Face
        parameter names -> tensors on the trainer's GPU (CPU tensors are accepted and simply not pushed to a
        GPU engine faster than a reload). The trainer calls it after committing the checkpoint, with exactly
        the weights it wrote, and leaves the tensors unchanged until the checkpoint's publish has loaded them.
        An offer replaces the one before, so at most one model's tensors are held here."""
        with self._lock:
            self._offered.clear()
            self._offered[checkpoint] = weights

    def take_offered(self, checkpoint: str) -> Mapping[str, torch.Tensor] | None:
        """The weights offered for ``checkpoint``, handed out once (None: read the checkpoint)."""
        with self._lock:
            return self._offered.pop(checkpoint, None)

    def close(self) -> None:
        """Release every live engine's processes and memory (vLLM engine core, Ray actors) and any offer. The
        object serves nothing afterwards: a flow's stages may not outlive it."""
        with self._lock:
            entries = list(self._live.values())
            self._live.clear()
            self._offered.clear()
            self._closed = True
        for entry in entries:
            entry.engine.close()
