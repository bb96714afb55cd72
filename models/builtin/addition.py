"""The built-in task: two-number addition, ``a+b=`` -> the decimal sum.

Pure data: seeded prompt streams and a fixed held-out set, disjoint from every training prompt.
The base-policy recipe and the rollout stage both draw from here, so they can never disagree on what
the task is.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from models.prompt import Prompt

TASK_NAME = "addition"
CHARACTERS = "0123456789+="  # the character tokenizer's alphabet: digits and the two signs a prompt holds
MAX_OPERAND = 99
HELD_OUT_SIZE = 500
_HELD_OUT_SEED = 20_250_101


def make_prompt(a: int, b: int) -> Prompt:
    return Prompt(prompt_id=f"add-{a}-{b}", task=TASK_NAME, text=f"{a}+{b}=", reference=str(a + b))


def _all_pairs() -> list[tuple[int, int]]:
    return [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]


def held_out_prompts() -> list[Prompt]:
    """The fixed evaluation set: 500 distinct pairs, never used for training."""
    pairs = random.Random(_HELD_OUT_SEED).sample(_all_pairs(), HELD_OUT_SIZE)
    return [make_prompt(a, b) for a, b in pairs]


def training_pairs() -> list[tuple[int, int]]:
    """Every pair not in the held-out set (9,500 of the 10,000)."""
    held = {p.prompt_id for p in held_out_prompts()}
    return [(a, b) for a, b in _all_pairs() if f"add-{a}-{b}" not in held]


def training_prompts(seed: int, count: int) -> list[Prompt]:
    """``count`` training prompts drawn uniformly (with replacement) by a seeded generator."""
    pairs = training_pairs()
    rng = random.Random(seed)
    return [make_prompt(*pairs[rng.randrange(len(pairs))]) for _ in range(count)]


def prompt_stream(seed: int) -> Iterator[Prompt]:
    """Endless uniform draws (with replacement) from the training pairs."""
    pairs = training_pairs()
    rng = random.Random(seed)
    while True:
        yield make_prompt(*pairs[rng.randrange(len(pairs))])


base_prompt_stream = prompt_stream
"""The base recipe's supervised examples: the task's own distribution, the draws of ``training_prompts``."""
base_validation_prompts = training_prompts
"""The examples the base recipe judges its stopping point on (with another seed than its training examples)."""


def longest_prompt() -> Prompt:
    """The prompt with the most tokens any stream can draw (for context checks)."""
    return make_prompt(MAX_OPERAND, MAX_OPERAND)
