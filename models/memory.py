"""What bounds a trainer's memory besides the scoring itself (models/logprobs.py budgets the logits):
activation checkpointing of the decoder layers, and low-rank adapters (LoRA, with ``peft``) trained in
place of the policy's own weights.

Pure torch over a loaded Hugging Face causal LM; the train stage decides when to use them (``TrainConfig``).

    adapted = add_adapters(model, rank=16, alpha=32, target_modules=[...], seed=0)
    train on adapted.get_base_model()        # the model itself, adapters injected, its own weights frozen
    save_adapters(adapted, directory)        # the adapters alone (peft's format), for audit
    merged = merged_policy(adapted)          # the plain model with the adapters folded into its weights
"""

from __future__ import annotations

from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers.modeling_layers import GradientCheckpointingLayer


def checkpoint_layers(model: Any) -> int:
    """Recompute each decoder layer in the backward pass instead of keeping its activations (the model's own
    gradient checkpointing, non-reentrant); returns how many layers will be.

    Hugging Face checkpoints a layer only while that layer is in training mode, and the policy trains in eval
    mode so that dropout never makes it score another policy than the engine sampled from. Only the layers'
    own flag is set, not their children's: attention and MLP dropout stay off. Call it after ``model.eval()``,
    which clears the flag. A checkpointed layer takes no KV cache; score with ``sequence_logprobs``."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24; the older name before
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer.training = True  # the layer's own flag only: ``train()`` would switch its children too
    return len(layers)


def checkpointed(model: Any) -> bool:
    """Whether any layer of ``model`` is checkpointed now (``checkpoint_layers`` after its ``eval()``)."""
    return any(
        isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and m.training for m in model.modules()
    )


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates: all of a fully fine-tuned policy's, the adapters of an adapted one."""
    return [p for p in model.parameters() if p.requires_grad]


ADAPTER_DIR = "adapter"
"""Where in a checkpoint directory the round's adapters are kept (peft's adapter_config.json and
adapter_model.safetensors), with their optimizer state."""


def add_adapters(model: Any, *, rank: int, alpha: float, target_modules: list[str], seed: int) -> Any:
    """Fresh LoRA adapters on ``model``'s ``target_modules``; returns the peft model around it. ``model``'s own
    weights are frozen; each adapter's second factor starts at zero, so the adapted policy starts as ``model``.
    The first factor's random start is drawn from ``seed``: a replay draws the same."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0)
        return get_peft_model(model, config)


def save_adapters(adapted: Any, directory: str) -> None:
    """The adapters alone, in peft's format (loadable onto the parent policy with ``PeftModel.from_pretrained``)."""
    adapted.save_pretrained(directory, safe_serialization=True)


def merged_policy(adapted: Any) -> Any:
    """The plain model with every adapter folded into the weight it adapts (what the engines load)."""
    return adapted.merge_and_unload()
