"""The recipe of a built-in base policy: its model size, training schedule and stopping point.

Kept apart from ``models.base_policy`` (which trains one) so that ``models.builtin`` can name each
task's recipe without importing the trainer, which itself looks tasks up in ``models.builtin``.
"""

from __future__ import annotations

from dataclasses import dataclass

RECIPE_VERSION = "2"  # the addition base's; bump when its recipe or data change (the cache name follows)


@dataclass(frozen=True)
class BaseRecipe:
    hidden_size: int = 128
    num_layers: int = 3
    intermediate_size: int = 384
    num_heads: int = 4
    max_steps: int = 1500
    check_every: int = 25
    stop_at_accuracy: float = 0.35  # validation accuracy at which training stops (RL needs headroom)
    batch_size: int = 128
    learning_rate: float = 1e-3
    seed: int = 0
    threads: int = 2  # float reductions split by thread count: fixing it makes every machine build the same policy
    max_position_embeddings: int = 64  # prompt plus the longest completion rollout may ask for
    length_buckets: int = 1  # >1: a batch runs as this many forward passes grouped by length (same loss, less padding)
    teacher_forced_checks: bool = False  # judge validation in one forward pass (teacher_forced_accuracy), not decoding
