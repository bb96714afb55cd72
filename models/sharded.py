"""A policy sharded across a ``torch.distributed`` process group with FSDP2, and its state's two forms.

Pure torch over a loaded Hugging Face causal LM; the worker group that drives it is tasks/train/worker_group.py.

    shard_policy(model)                  fully_shard each decoder layer, then the root
    full_weights(model)                  every rank takes part; rank 0 gets the whole state on the CPU
    save_optimizer_shards / load_...     the optimizer state with torch.distributed.checkpoint (DCP)
    plain_optimizer_state(dir, model)    a DCP optimizer directory as one process's ``state_dict``
    resident_bytes(model, optimizer)     this rank's parameter, gradient and optimizer-state bytes

Optimizer state is kept in two forms. A one-process trainer saves ``optimizer.pt``, a plain
``Optimizer.state_dict()`` keyed by parameter index. A worker group saves ``optimizer/``, a DCP
directory keyed by parameter name, one file per rank plus the metadata; DCP reshards on load, so the
next round may run at another worker count, and ``plain_optimizer_state`` reads it back into one
process. Either form continues at any worker count.
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

OPTIMIZER_FILE = "optimizer.pt"  # a one-process trainer's state_dict
OPTIMIZER_DIR = "optimizer"  # a worker group's DCP directory


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (``model.model.layers`` in Llama, Qwen, Mistral...)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} keeps no decoder layers at model.model.layers; sharded training "
            "(train.workers > 1) supports Llama-shaped causal LMs: use train.workers 1 for this model"
        )
    return list(layers)


def shard_policy(model) -> torch.nn.Module:
    """Shard parameters, gradients and optimizer state across the process group: one FSDP unit per decoder
    layer, so a forward gathers one layer's weights at a time, and the root for the rest (embeddings,
    final norm, head). The process group must be up and the model on this rank's device."""
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def full_weights(model) -> dict[str, torch.Tensor] | None:
    """The whole state of a sharded model, gathered onto the CPU of rank 0 (None elsewhere). A collective:
    every rank calls it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return state if torch.distributed.get_rank() == 0 else None


def save_optimizer_shards(model, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """This rank's share of the optimizer state into ``directory`` (DCP; rank 0 also writes the metadata).
    A collective."""
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=directory)


def load_optimizer_shards(model, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Continue from a DCP optimizer directory written at any worker count. A collective."""
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # allocates the state to load into
    dcp.load(state, checkpoint_id=directory)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_plain_optimizer(model, optimizer: torch.optim.Optimizer, plain: dict) -> None:
    """Continue a sharded model's optimizer from a one-process ``state_dict`` (keyed by parameter index).
    Every rank passes the whole state and keeps its shard. A collective."""
    names = [name for name, _ in model.named_parameters()]
    by_name = {
        "state": {names[index]: value for index, value in plain["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in plain["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def plain_optimizer_state(directory: str, model) -> dict:
    """A DCP optimizer directory as the ``state_dict`` of one process's optimizer over ``model``'s parameters,
    read without a process group."""
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    with tempfile.TemporaryDirectory(prefix="rlrounds-dcp-") as tmp:
        dcp_to_torch_save(directory, f"{tmp}/state.pt")
        whole = torch.load(f"{tmp}/state.pt", weights_only=True)["optimizer"]
    return {
        "state": {index[name]: value for name, value in whole["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in whole["param_groups"]],
    }


def resident_bytes(model, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank holds of the parameters, their gradients and the optimizer state, in bytes: the local
    shards of a sharded model, everything of a whole one."""

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    def size(tensor: torch.Tensor) -> int:
        tensor = local(tensor)
        return tensor.numel() * tensor.element_size()

    params = list(model.parameters())
    return {
        "parameters": sum(size(p) for p in params),
        "gradients": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            size(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
        ),
    }
