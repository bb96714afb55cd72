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
