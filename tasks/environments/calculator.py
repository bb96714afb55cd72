"""The built-in agentic task: add two numbers too long to add in one's head, with a calculator tool.

The policy is asked for ``A + B`` where A and B have ``digits`` digits; it may call ``add`` (run in the sandbox
pool) and then answers ``The answer is N.``; the reward is 1 when N is the sum. The tool answers exactly whatever the
numbers' length, so a policy that learns to call it and copy its answer succeeds where one that adds in its head
fails on long numbers.
"""

from __future__ import annotations

import random
import re

from models.prompt import Prompt
from tasks.environments.types import Observation, ToolEnvironment

TASK_NAME = "calculator"
SYSTEM = (
    "Use the add tool to add the numbers, then answer with: The answer is N. "
    'Call it as <tool_call>{"name": "add", "arguments": {"a": A, "b": B}}</tool_call>'
)


def add(a: int, b: int) -> int:
    """Add two integers exactly, however many digits they have.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def calculator_prompts(count: int, *, digits: int = 12, seed: int = 0) -> list[Prompt]:
    """``count`` seeded questions ``A + B`` of ``digits``-digit numbers, the sum as the reference."""
    rng = random.Random(f"{TASK_NAME}/{digits}/{seed}")
    prompts = []
    for _ in range(count):
        a, b = (rng.randrange(10 ** (digits - 1), 10**digits) for _ in range(2))
        prompts.append(
            Prompt(prompt_id=f"calc-{a}-{b}", task=TASK_NAME, text=f"What is {a} + {b}?", reference=str(a + b))
        )
    return prompts


_ANSWER = re.compile(r"answer is\s*(-?\d+)", re.IGNORECASE)


class CalculatorEnvironment(ToolEnvironment):
    """One episode of the calculator task; in config,
    ``round.environment: tasks.environments.calculator:CalculatorEnvironment``."""

    tool_functions = (add,)

    def reset(self, prompt: Prompt) -> Observation:
        self.prompt = prompt
        return Observation(prompt.text, system=SYSTEM)

    def score(self, answer_text: str) -> float | None:
        match = _ANSWER.findall(answer_text)
        return 1.0 if match and self.prompt is not None and match[-1] == self.prompt.reference else 0.0
