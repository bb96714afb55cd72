"""The built-in agentic task: add two numbers too long to add in one's head, with an ``add`` tool.

A prompt is ``A+B=`` with A and B of ``MIN_DIGITS`` to ``MAX_DIGITS`` digits; the reference is the sum. The
policy may answer at once (the sum, in its head: a tiny model almost never gets it right), or call the tool first
and copy its answer. An episode that calls the tool is, token for token,

    A+B=            the prompt
    [A+B]           the policy's call: its turn ends at ``CALL_END`` (a stop string)
    S;              the environment's observation: the tool's answer, written by ``OBSERVATION``
    S</s>           the policy's final answer, then end-of-sequence

and one that does not is ``A+B=`` then ``S</s>``. The environment (tasks/environments/tooladd.py) reads the call
with ``read_call`` and writes the observation with ``OBSERVATION``, so the base's examples below and the episodes
agree on every character.

Pure data, like ``models.builtin.addition``: seeded prompt streams and a fixed held-out set of 200 prompts,
disjoint from every training prompt. The base recipe's examples (``base_prompt_stream``) are whole episodes: the
longer the operands, the more often they call the tool (``call_probability``), so the base sometimes calls it and
sometimes answers in its head, and RL has headroom: to call it always.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from models.prompt import Prompt

TASK_NAME = "tooladd"
CHARACTERS = "0123456789+=[];"
"""The character tokenizer's alphabet: digits, the prompt's two signs, the call's brackets and the observation's end."""
MIN_DIGITS = 6
MAX_DIGITS = 8
HELD_OUT_SIZE = 200
_HELD_OUT_SEED = 20_250_601

CALL_END = "]"
"""The stop string of a policy turn that calls the tool (the episode's turns end there or at end-of-sequence)."""
OBSERVATION = "{text};"
"""How the environment writes the tool's answer after a call (``str.format`` with ``text``)."""
MAX_CALL_DIGITS = 20
"""The most digits an argument of a call may have; a longer one is not a call (nothing huge reaches the tool)."""
_CALL = re.compile(rf"\[([0-9]{{1,{MAX_CALL_DIGITS}}})\+([0-9]{{1,{MAX_CALL_DIGITS}}})\]")  # ASCII digits only


def tool_call(a: int, b: int) -> str:
    """The policy's text that calls ``add(a, b)``."""
    return f"[{a}+{b}]"


def read_call(text: str) -> tuple[int, int] | None:
    """(a, b) when ``text`` is exactly one call (``tool_call``), else None: the text is a final answer."""
    match = _CALL.fullmatch(text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def observation_spans(reference: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of a base example's reference that the environment writes (the tool's answer
    after each call, its ``;`` included): the recipe leaves them out of its loss, as RL leaves observations out."""
    spans = []
    for call in re.finditer(re.escape(CALL_END), reference):
        end = reference.find(";", call.end())
        if end >= 0:
            spans.append((call.end(), end + 1))
    return spans


def make_prompt(a: int, b: int) -> Prompt:
    return Prompt(prompt_id=f"tooladd-{a}-{b}", task=TASK_NAME, text=f"{a}+{b}=", reference=str(a + b))


def longest_prompt() -> Prompt:
    """The prompt with the most tokens any stream can draw (for context checks)."""
    largest = 10**MAX_DIGITS - 1
    return make_prompt(largest, largest)


def _draw(rng: random.Random) -> tuple[int, int]:
    a_digits, b_digits = rng.randint(MIN_DIGITS, MAX_DIGITS), rng.randint(MIN_DIGITS, MAX_DIGITS)
    return rng.randrange(10 ** (a_digits - 1), 10**a_digits), rng.randrange(10 ** (b_digits - 1), 10**b_digits)


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
    """The fixed evaluation set: 200 distinct pairs drawn from the task's distribution."""
    return [make_prompt(*pair) for pair in sorted(held_out_set())]


def prompt_stream(seed: int) -> Iterator[Prompt]:
    """Endless training prompts, never one of the held-out set."""
    rng = random.Random(seed)
    held = held_out_set()
    while True:
        pair = _draw(rng)
        if pair not in held:
            yield make_prompt(*pair)


def training_prompts(seed: int, count: int) -> list[Prompt]:
    stream = prompt_stream(seed)
    return [next(stream) for _ in range(count)]


def call_probability(a: int, b: int) -> float:
    """How often a base example of ``a+b`` calls the tool: 0.2 for two operands of ``MIN_DIGITS`` digits up to 0.8
    for two of ``MAX_DIGITS``, 0.5 on average. Tied to a feature the policy sees, the choice is the prompt's, not a
    coin the base flips the same way on every prompt: greedy decoding calls on the long ones only and leaves RL
    headroom as sampling does."""
    extra = len(str(a)) + len(str(b)) - 2 * MIN_DIGITS  # 0 .. 2 * (MAX_DIGITS - MIN_DIGITS)
    return 0.2 + 0.6 * extra / (2 * (MAX_DIGITS - MIN_DIGITS))


def episode_text(a: int, b: int, *, calls: bool) -> str:
    """Everything after the prompt ``a+b=`` in an episode that answers right: the call and the tool's answer first
    when it ``calls``, then the sum (end-of-sequence is the recipe's to add)."""
    total = str(a + b)
    return f"{tool_call(a, b)}{OBSERVATION.format(text=total)}{total}" if calls else total


def base_prompt_stream(seed: int) -> Iterator[Prompt]:
    """The base recipe's supervised examples, endless: training prompts whose reference is the whole episode
    (``episode_text``), calling the tool with ``call_probability``. The observation's characters are the
    environment's (``observation_spans``), not the policy's."""
    rng = random.Random(f"{TASK_NAME}/calls/{seed}")
    for prompt in prompt_stream(seed):
        a, b = (int(x) for x in prompt.text.removesuffix("=").split("+"))
        calls = rng.random() < call_probability(a, b)
        yield Prompt(
            prompt_id=prompt.prompt_id, task=TASK_NAME, text=prompt.text, reference=episode_text(a, b, calls=calls)
        )


def base_validation_prompts(seed: int, count: int) -> list[Prompt]:
    """The examples the recipe judges its stopping point on: ``count`` base examples (another seed than training's)."""
    stream = base_prompt_stream(seed)
    return [next(stream) for _ in range(count)]
