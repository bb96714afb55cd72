"""A policy sharded across a ``torch.distributed`` process group with FSDP2, and its state's two forms.

Pure torch over a loaded Hugging Face causal LM; the worker group that drives it is tasks/train/worker_group.py.

    empty_policy(path)                   the checkpoint's architecture, parameters on the meta device (no storage)
    shard_policy(model, precision)       fully_shard each decoder layer, then the root (bf16: a mixed-precision policy)
    load_shards(model, path, device)     this rank's shards given storage and read from the checkpoint, tensor by tensor
    full_weights(model)                  every rank takes part; rank 0 gets the whole state on the CPU
    save_optimizer_shards / load_...     the optimizer state with torch.distributed.checkpoint (DCP)
    plain_optimizer_state(dir, model)    a DCP optimizer directory as one process's ``state_dict``
    save_optimizer / load_optimizer      a one-process trainer's state (``optimizer.pt``); load reads either form
    resident_bytes(model, optimizer)     this rank's parameter, gradient and optimizer-state bytes

Optimizer state is kept in two forms. A one-process trainer saves ``optimizer.pt``, a plain
``Optimizer.state_dict()`` keyed by parameter index. A worker group saves ``optimizer/``, a DCP
directory keyed by parameter name, one file per rank plus the metadata; DCP reshards on load, so the
next round may run at another worker count, and ``plain_optimizer_state`` reads it back into one
process. Either form continues at any worker count.

A worker never holds the whole model: it builds the policy on the meta device, shards it, and then reads the
checkpoint one tensor at a time, keeping its own shard of each (``load_shards``). Its peak is its shards plus
the largest single tensor (the embedding, in most causal LMs).
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from collections.abc import Iterable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoConfig, AutoModelForCausalLM

from models.checkpoint import PolicyLoadError, check_policy_dir

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


def mixed_precision(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2's precision for a ``train.precision`` ('fp32' or 'bf16'): under bf16 each layer's weights are gathered
    and used in bfloat16 while the sharded master weights and the optimizer state stay float32, and gradients are
    reduced across ranks in float32 (summing bf16 gradients over many ranks loses the small ones). None in fp32."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def shard_policy(model, precision: str = "fp32") -> torch.nn.Module:
    """Shard parameters, gradients and optimizer state across the process group: one FSDP unit per decoder
    layer, so a forward gathers one layer's weights at a time, and the root for the rest (embeddings,
    final norm, head). The process group must be up; the model on this rank's device, or on the meta device
    (``empty_policy``, then ``load_shards``)."""
    policy = mixed_precision(precision)
    options = {} if policy is None else {"mp_policy": policy}
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside keep their parameters on the meta device (shape and dtype, no storage) and their
    buffers as built: a rotary embedding's frequencies are computed at construction and are in no checkpoint.
    Each parameter is created, never written to, and moved to meta as it is registered, so the whole model never
    exists at once; the initialisers then run on meta tensors and draw no random numbers."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:  # a tied head is registered with the meta embedding itself
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def empty_policy(path: str) -> torch.nn.Module:
    """The causal LM of a Hugging Face directory with float32 parameters on the meta device, in eval mode: the
    skeleton ``shard_policy`` shards and ``load_shards`` fills."""
    check_policy_dir(path)
    config = AutoConfig.from_pretrained(path)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def adapters_on_meta(model, *, rank: int, alpha: float, target_modules: list[str], seed: int):
    """``models.memory.add_adapters`` on a model built by ``empty_policy``: returns (the peft model, the adapters'
    starting values by parameter name). peft would move each adapter to its base layer's device, meta, and lose the
    values it drew, so the base layers are shown to it as storage-free CPU stand-ins (a scalar expanded to their
    shape) while it works: it draws the same values as on a loaded policy, which ``load_shards`` then puts in place."""
    from models.memory import add_adapters  # peft: only a LoRA round's workers import it

    stand_ins: dict[int, tuple[torch.nn.Module, str, torch.nn.Parameter]] = {}
    for module in model.modules(remove_duplicate=False):
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                stand_in = torch.nn.Parameter(torch.zeros((), dtype=param.dtype).expand(param.shape))
                module._parameters[name] = stand_in
                stand_ins[id(stand_in)] = (module, name, param)
    adapted = add_adapters(model, rank=rank, alpha=alpha, target_modules=target_modules, seed=seed)
    start = {
        name: p.detach().clone() for name, p in adapted.get_base_model().named_parameters() if id(p) not in stand_ins
    }
    for module in adapted.get_base_model().modules(remove_duplicate=False):
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in stand_ins:
                _, _, meta = stand_ins[id(param)]
                module._parameters[name] = meta.requires_grad_(param.requires_grad)  # peft froze the base
    return adapted, start


def load_shards(model, path: str, device: torch.device, start: dict[str, torch.Tensor] | None = None) -> int:
    """Give a sharded model built on the meta device (``empty_policy``, ``shard_policy``) storage on ``device``
    and fill it from the checkpoint in ``path``: each tensor is read alone, cast to the parameter's dtype, and only
    this rank's shard of it is kept. Every rank reads the file itself, so loading needs no collective. Tied
    parameters (an output head sharing the embedding) are filled once. Returns the most bytes of any one whole
    tensor read (this rank's peak beyond its shards). ``start``: the values of parameters the checkpoint has not
    (fresh adapters, ``adapters_on_meta``); a checkpoint's weight fills an adapted layer's ``base_layer``."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}  # built real; to_empty wipes them
    tied: dict[int, list[tuple[torch.nn.Module, str]]] = {}  # every module holding each parameter, first holder first
    for module in model.modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            tied.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)  # each holder of a tied parameter gets a new one of its own: tie them again
    for (holder, name), *others in tied.values():
        for module, other in others:
            setattr(module, other, getattr(holder, name))  # FSDP keeps the first holder's (``reset_sharded_param``)
    targets = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    targets.update({name.replace(".base_layer.", "."): t for name, t in targets.items() if ".base_layer." in name})
    filled, largest = set(), 0

    def fill(key: str, whole: torch.Tensor) -> None:
        nonlocal largest
        target = targets[key]
        whole = whole.to(device=device, dtype=target.dtype)
        largest = max(largest, whole.numel() * whole.element_size())
        if isinstance(target, DTensor):  # the same split FSDP made, taken here without communication
            whole = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(whole.to_local())
        else:
            target.copy_(whole)
        filled.add(id(target))

    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            with safe_open(file, framework="pt", device="cpu") as tensors:
                for key in tensors.keys():
                    if key not in targets:
                        raise PolicyLoadError(
                            f"checkpoint {path} holds {key!r}, which the model it describes has not; load a "
                            "checkpoint of the same architecture"
                        )
                    fill(key, tensors.get_tensor(key))
        for key, value in (start or {}).items():
            fill(key, value)
    missing = [name for name, p in model.named_parameters() if id(p) not in filled]
    if missing:
        raise PolicyLoadError(
            f"checkpoint {path} lacks {missing[:3]} of the model it describes; load a complete checkpoint"
        )
    return largest


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


def with_group_keys(optimizer: torch.optim.Optimizer, names: Iterable[str]) -> None:
    """Give the optimizer's parameter groups the keys of their own a saved state's groups hold (the learning-rate
    scale of ``train.drift_target``), as placeholders the load overwrites: the distributed loaders build the state
    to load into from the optimizer's groups, and would refuse or drop a key those lack."""
    for group in optimizer.param_groups:
        for name in set(names) - {"params"}:
            group.setdefault(name, None)


def load_optimizer_shards(model, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Continue from a DCP optimizer directory written at any worker count. A collective."""
    prefix = "optimizer.param_groups."
    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    with_group_keys(optimizer, {key.split(".")[3] for key in saved if key.startswith(prefix)})
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # allocates the state to load into
    dcp.load(state, checkpoint_id=directory)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_plain_optimizer(model, optimizer: torch.optim.Optimizer, plain: dict) -> None:
    """Continue a sharded model's optimizer from a one-process ``state_dict`` (keyed by parameter index).
    Every rank passes the whole state and keeps its shard. A collective."""
    names = [name for name, _ in model.named_parameters()]
    with_group_keys(optimizer, {key for group in plain["param_groups"] for key in group})
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


def save_optimizer(state: dict, directory: str) -> None:
    """A one-process trainer's optimizer ``state_dict`` (its tensors on the CPU) into the checkpoint ``directory``."""
    torch.save(state, os.path.join(directory, OPTIMIZER_FILE))


def load_optimizer(directory: str, model) -> dict | None:
    """The optimizer state a checkpoint continues with, as one process's ``state_dict`` over ``model``: its
    ``optimizer.pt``, or the shards a worker group saved (``optimizer/``), or None (a base)."""
    path = os.path.join(directory, OPTIMIZER_FILE)
    if os.path.exists(path):
        return torch.load(path, weights_only=True, map_location="cpu")
    if os.path.isdir(os.path.join(directory, OPTIMIZER_DIR)):
        return plain_optimizer_state(os.path.join(directory, OPTIMIZER_DIR), model)
    return None


def on_cpu(state):
    """A nested state (dicts, lists of tensors) with every tensor moved to the CPU."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [on_cpu(v) for v in state]
    return state


def resident_bytes(model, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
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
            size(v)
            for state in (optimizer.state.values() if optimizer is not None else [])
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ),
    }
