"""The long-tail task: count down, ``a>b=`` -> ``a,a-1,...,b``.

Built so that completion lengths have a real tail, as reasoning traces do in RL post-training:

- the answer's length grows with the input: a span of ``s`` steps is ``s + 1`` numbers, about
  ``4(s + 1)`` characters; spans are drawn with probability proportional to ``s**-1.8`` (1 to 20), so
  most answers are a few tokens (p50 8) and one in a hundred is about eight times longer or more;
- a wrong step runs on: the policy stops when it writes ``b``, so a sample that skips past ``b``
  (a borrow gone wrong, a number dropped) keeps counting down, the way wrong reasoning does; it stops
  about where the base's longest example ends (``BASE_MAX_SPAN``), or at ``rollout.max_tokens``.

Pure data, like ``models.addition``: seeded prompt streams and a fixed held-out set of 500 prompts
drawn from the same distribution, disjoint from every training prompt. The base recipe's supervised
examples (``base_prompt_stream``) draw spans from a flatter distribution than the task's (below).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from models.prompt import Prompt

TASK_NAME = "longtail"
CHARACTERS = "0123456789>,="
MAX_START = 999
MAX_SPAN = 20
SPAN_EXPONENT = 1.8
BASE_MAX_SPAN = 23
"""The base recipe's longest span: 24 numbers, 95 characters at most, past the task's longest answer (84).
A run-on ends about where the base's longest example does: a base whose examples stopped at the task's
longest (v2) kept its samples' tail shorter than the preset is there to show; this one runs on to
``rollout.max_tokens`` often enough for a long tail (docs/performance.md). Changing it changes the base: bump the
recipe version in ``models.builtin`` with it."""
BASE_SPAN_EXPONENT = 1.0
"""Spans of the base recipe's supervised examples, drawn with weight ``1/s``: flatter than the task's, so
the base has counted down (72% of its examples count past the first number, against 44% of the task's
prompts). RL sharpens what a base sometimes gets right. A base trained on the task's own spans learns to
copy the two numbers of a span-1 prompt long before it counts down, and RL on it climbed slowly
(docs/performance.md)."""
HELD_OUT_SIZE = 500
_HELD_OUT_SEED = 20_250_414
_SPANS = list(range(1, MAX_SPAN + 1))
_SPAN_WEIGHTS = [s**-SPAN_EXPONENT for s in _SPANS]
_BASE_SPANS = list(range(1, BASE_MAX_SPAN + 1))
_BASE_SPAN_WEIGHTS = [s**-BASE_SPAN_EXPONENT for s in _BASE_SPANS]


def countdown(start: int, stop: int) -> str:
    """'12,11,10': every integer from ``start`` down to ``stop``, comma-separated."""
    return ",".join(str(n) for n in range(start, stop - 1, -1))


def make_prompt(start: int, span: int) -> Prompt:
    stop = start - span
    return Prompt(
        prompt_id=f"down-{start}-{stop}", task=TASK_NAME, text=f"{start}>{stop}=", reference=countdown(start, stop)
    )


def longest_prompt() -> Prompt:
    """The prompt with the most tokens any stream can draw (for context checks)."""
    return make_prompt(MAX_START, MAX_SPAN)


def _draw(rng: random.Random, spans: list[int] = _SPANS, weights: list[float] = _SPAN_WEIGHTS) -> tuple[int, int]:
    span = rng.choices(spans, weights=weights)[0]
    return rng.randint(span, MAX_START), span


def _held_out_pairs() -> set[tuple[int, int]]:
    rng = random.Random(_HELD_OUT_SEED)
    pairs: dict[tuple[int, int], None] = {}  # insertion order: the set is the same on every machine
    while len(pairs) < HELD_OUT_SIZE:
        pairs.setdefault(_draw(rng))
    return set(pairs)


_HELD_OUT: set[tuple[int, int]] | None = None


def held_out_set() -> set[tuple[int, int]]:
    global _HELD_OUT
    if _HELD_OUT is None:
        _HELD_OUT = _held_out_pairs()
    return _HELD_OUT


def held_out_prompts() -> list[Prompt]:
    """The fixed evaluation set: 500 distinct (start, span) pairs drawn from the task's distribution."""
    return [make_prompt(*pair) for pair in sorted(held_out_set())]


def prompt_stream(seed: int, spans: list[int] = _SPANS, weights: list[float] = _SPAN_WEIGHTS) -> Iterator[Prompt]:
    """Endless training prompts from the task's distribution (or ``spans`` drawn by ``weights``), never one
    of the held-out set."""
    rng = random.Random(seed)
    held = held_out_set()
    while True:
        pair = _draw(rng, spans, weights)
        if pair not in held:
            yield make_prompt(*pair)


def training_prompts(seed: int, count: int) -> list[Prompt]:
    stream = prompt_stream(seed)
    return [next(stream) for _ in range(count)]


def base_prompt_stream(seed: int) -> Iterator[Prompt]:
    """The base recipe's supervised examples, endless: spans 1 to ``BASE_MAX_SPAN`` drawn by
    ``BASE_SPAN_EXPONENT``, never held out."""
    return prompt_stream(seed, _BASE_SPANS, _BASE_SPAN_WEIGHTS)


base_validation_prompts = training_prompts
"""The examples the base recipe judges its stopping point on: the task's own prompts (another seed)."""
