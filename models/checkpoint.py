"""Checkpoint I/O: load and save any Hugging Face causal-LM directory.

A checkpoint directory is plain Hugging Face format (config.json, tokenizer files, safetensors)
plus ``lineage.json`` (where it came from) and ``optimizer.pt`` (so training resumes exactly).
Directories here are local; storage/ copies them to and from remote roots.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

WEIGHTS_FILE = "model.safetensors"
REQUIRED_FILES = ("config.json", "tokenizer_config.json")

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


class PolicyLoadError(ValueError):
    pass


def torch_dtype(name: str) -> torch.dtype:
    try:
        return getattr(torch, _DTYPES[name])
    except KeyError:
        raise PolicyLoadError(f"unknown dtype {name!r}; use one of float32, bfloat16, float16") from None


def set_threads(count: int) -> int:
    """Have torch use ``count`` threads (at least 1); returns the count it used before.

    ``torch.set_num_threads`` is called only when the count changes: the call, even with the count
    already in use, leaves the process's OpenMP threads waking each other by system call at every
    parallel op from then on, which slows every later round's training (``benchmarks/train_step.py``
    measures it; docs/performance.md)."""

    previous, count = torch.get_num_threads(), max(1, count)
    if count != previous:
        torch.set_num_threads(count)
    return previous


def check_policy_dir(path: str) -> None:
    """Fail with one line naming what is missing, before any weights are read."""
    if not os.path.isdir(path):
        raise PolicyLoadError(
            f"policy directory {path} does not exist; set policy.base_model to a Hugging Face causal-LM directory or "
            "'builtin'"
        )
    missing = [f for f in REQUIRED_FILES if not os.path.exists(os.path.join(path, f))]
    if not any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path)):
        missing.append("model weights (*.safetensors)")
    if missing:
        raise PolicyLoadError(
            f"policy directory {path} is missing {', '.join(missing)}; point to a complete Hugging Face checkpoint"
        )


_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_length(path: str) -> int | None:
    """Positions the model can attend over, from its config.json (None when the config does not say).

    Read as JSON, without transformers, so input checks stay cheap; text models nested in a
    multimodal config keep theirs under ``text_config``."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise PolicyLoadError(
            f"policy directory {path}: config.json is unreadable ({exc}); point to a complete Hugging Face checkpoint"
        ) from None
    for scope in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(scope.get(key), int) and scope[key] > 0:
                return scope[key]
    return None


def stop_token_ids(path: str, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a sample: the tokenizer's end-of-sequence token and the model's own, from its
    generation_config.json (else config.json), where instruct models often list several (an end-of-turn token
    beside end-of-text). Read as JSON, so both engines get the same set."""
    ids = set() if tokenizer.eos_token_id is None else {int(tokenizer.eos_token_id)}
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(path, name)) as f:
                listed = json.load(f).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if listed is not None:
            ids.update(int(i) for i in (listed if isinstance(listed, list) else [listed]))
            break
    if not ids:
        raise PolicyLoadError(
            f"policy directory {path} names no end-of-sequence token; set eos_token in its tokenizer_config.json"
        )
    return tuple(sorted(ids))


def load_policy(path: str, dtype: str = "float32", device: torch.device | str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) from a Hugging Face causal-LM directory, in eval mode on ``device`` (the CPU unless
    told: ``models.device.resolve_device`` turns a round's setting into one)."""
    hf_logging.disable_progress_bar()  # per-load bars drown the round's own progress
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype))
    return model.to(device).eval(), tokenizer


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a Hugging Face causal-LM directory, with a padding token."""
    check_policy_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:  # many causal LMs ship without one; eos is the usual stand-in
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_state_dict(path: str, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A checkpoint's weights, read onto ``device``."""
    return load_file(os.path.join(path, WEIGHTS_FILE), device=str(device))


def assign_weights(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Copy a checkpoint's weights into ``model`` in place. A model with tied embeddings (most small instruct
    models) is saved without its output head, which shares the embedding's tensor and so is loaded with it;
    any other key missing or extra is an error."""
    result = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[k].data_ptr() for k in state if k in params}
    untied = [k for k in result.missing_keys if k not in params or params[k].data_ptr() not in loaded]
    if untied or result.unexpected_keys:
        raise PolicyLoadError(
            f"checkpoint weights do not fit the served model (missing {untied[:3]}, unexpected "
            f"{result.unexpected_keys[:3]}); load a checkpoint of the same architecture"
        )


def save_policy(model: Any, tokenizer: Any, path: str) -> None:
    """Write ``model`` and ``tokenizer`` as a Hugging Face directory, from CPU tensors wherever the model lives,
    so a checkpoint saved on one device loads on any other."""
    hf_logging.disable_progress_bar()
    os.makedirs(path, exist_ok=True)
    on_cpu = all(t.device.type == "cpu" for t in model.state_dict().values())
    model.save_pretrained(path, state_dict=None if on_cpu else cpu_state_dict(model), safe_serialization=True)
    tokenizer.save_pretrained(path)


def cpu_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """``model``'s state as CPU tensors, without moving the model (on the CPU already, its own tensors). Tensors
    that share memory on the device (tied embeddings) share one copy, so ``save_pretrained`` still sees them as
    tied and writes the weight once."""
    copies: dict[tuple, torch.Tensor] = {}
    state = {}
    for name, tensor in model.state_dict().items():
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride())
        if where not in copies:
            copies[where] = tensor.cpu()
        state[name] = copies[where]
    return state
