"""Where a stage computes, and at what precision it trains.

One setting, ``device`` in a round's config, places every stage that runs torch in this process or its
workers: the trainer, the embedded engine, evaluation and the base build. ``auto`` is CUDA when a CUDA
device is visible and the CPU otherwise; ``cpu``, ``cuda`` and ``cuda:N`` ask for one. Weights are always
saved from CPU tensors (``models.checkpoint.save_policy``), so a checkpoint trained on one device loads
on any other.

Training precision (``train.precision``): ``fp32``, or ``bf16`` autocast over fp32 master weights and
fp32 optimizer state, where matrix products run in bfloat16 and the loss, logprobs and updates stay in
float32. ``auto`` is bf16 on CUDA and fp32 on the CPU.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re

import torch

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class DeviceError(RuntimeError):
    pass


def resolve_device(setting: str = "auto") -> torch.device:
    """The torch device a setting names, refusing one this machine does not have in one line."""
    if not DEVICE_PATTERN.match(setting):
        raise DeviceError(f"device {setting!r} is not one of auto, cpu, cuda, cuda:N")
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device {setting!r} asked for CUDA, but torch {torch.__version__} sees no CUDA device here; "
                "set device to 'auto' or 'cpu', or install a CUDA build of torch on a machine with a GPU"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(
                f"device {setting!r}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0"
            )
    return device


def resolve_precision(setting: str, device: torch.device) -> str:
    """'fp32' or 'bf16' for a ``train.precision`` setting on ``device``."""
    if setting == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if setting == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError(f"train.precision 'bf16' needs a GPU with bfloat16 support; {device} has none: use 'fp32'")
    return setting


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The forward-pass context of a precision: bf16 autocast, or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def distributed_backend(device: torch.device) -> str:
    """The ``torch.distributed`` backend for workers on ``device``: NCCL between GPUs, gloo on CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


def deterministic_kernels() -> None:
    """Ask torch for deterministic kernels (``RLROUNDS_DETERMINISTIC=1``): on CUDA, some reductions and
    scatters are otherwise free to sum in any order, so a replay matches within tolerance, not bit for bit."""
    if os.environ.get("RLROUNDS_DETERMINISTIC") == "1":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: plain 'cuda' is this process's first visible GPU, cuda:0. Ray shows a GPU actor
    only the GPU it was given (``CUDA_VISIBLE_DEVICES``), as cuda:0; ``torch.cuda.set_device`` and NCCL's
    communicators want an index, and refuse a device without one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", 0)
    return device


def engine_dtype(setting: str, on_gpu: bool) -> str:
    """The precision an engine serves at for a ``rollout.dtype`` or ``evaluate.serving_dtype`` setting: 'auto' is
    bfloat16 on a GPU (where vLLM's and torch's fast attention kernels run) and float32 on the CPU; any other
    setting is itself."""
    if setting == "auto":
        return "bfloat16" if on_gpu else "float32"
    return setting


def running_sum(values: torch.Tensor) -> torch.Tensor:
    """``values.cumsum(-1)``, also under ``RLROUNDS_DETERMINISTIC=1`` on a GPU, where torch has no deterministic
    floating-point cumulative sum and refuses one: it is then taken on the CPU, sequentially, and moved back. Rows
    of a vocabulary's probabilities are small beside a forward pass; elsewhere nothing changes, bit for bit."""
    if values.device.type != "cpu" and values.is_floating_point() and torch.are_deterministic_algorithms_enabled():
        return values.cpu().cumsum(-1).to(values.device)
    return values.cumsum(-1)


def release_cached_memory() -> None:
    """Return the memory torch's CUDA allocator keeps cached to the GPU (after collecting what nothing holds), so
    that a vLLM engine starting next finds it free: vLLM sizes itself from the GPU's free memory and refuses to
    start below ``gpu_memory_utilization`` of it. Nothing to do without CUDA."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
