"""What bounds a trainer's memory besides the scoring itself (models/logprobs.py budgets the logits):
activation checkpointing of the decoder layers.

Pure torch over a loaded Hugging Face causal LM; the train stage decides when to use it (``TrainConfig``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_layers import GradientCheckpointingLayer


def checkpoint_layers(model: Any) -> int:
    """Recompute each decoder layer in the backward pass instead of keeping its activations (the model's own
    gradient checkpointing, non-reentrant); returns how many layers will be.

    Hugging Face checkpoints a layer only while that layer is in training mode, and the policy trains in eval
    mode so that dropout never makes it score another policy than the engine sampled from. Only the layers'
    own flag is set, not their children's: attention and MLP dropout stay off. Call it after ``model.eval()``,
    which clears the flag. A checkpointed layer takes no KV cache; score with ``sequence_logprobs``."""
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
    """The parameters the optimizer updates: all of a fully fine-tuned policy's."""
    return [p for p in model.parameters() if p.requires_grad]
