"""The built-in tool-use task for the character-level policy: add two long numbers by calling ``add``.

The task's data and its compact format live in models/builtin/tooladd.py (the base recipe's examples use the same
format). An episode that calls the tool runs

    prompt   1234567+7654321=
    policy   [1234567+7654321]      a call: the turn ends at ``]`` (a stop string of the episode)
    tool     8888888;               the tool's answer, appended as the observation (masked out of the loss)
    policy   8888888</s>            the final answer

A turn that is exactly one call ``[A+B]`` runs ``add(A, B)`` in the sandbox pool; any other turn is the final
answer, rewarded 1 when it is the sum. A malformed call (``[12+x]``, a call cut off by end-of-sequence, an argument
of more than ``MAX_CALL_DIGITS`` digits) is therefore a final answer that is not a number: a model failure, reward
0, and nothing the model wrote reaches the tool unparsed. The prompt is the task's text alone: the character
tokenizer's alphabet has no room for a tool list, and the base learned the format from its examples.

In config: ``round.environment: tasks.environments.tooladd:TooladdEnvironment``.
"""

from __future__ import annotations

from models.builtin import tooladd
from models.prompt import Prompt
from tasks.environments.tools import ToolCall
from tasks.environments.types import Observation, PlainFormat, ToolEnvironment


def add(a: int, b: int) -> int:
    """Add two integers exactly, however many digits they have.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


class TooladdEnvironment(ToolEnvironment):
    """One episode of the tooladd task (module doc)."""

    tool_functions = (add,)
    plain_format = PlainFormat(show_tools=False, observation=tooladd.OBSERVATION, stop=(tooladd.CALL_END,))

    def reset(self, prompt: Prompt) -> Observation:
        self.prompt = prompt
        return Observation(prompt.text)

    def parse_call(self, action_text: str) -> ToolCall | None:
        operands = tooladd.read_call(action_text)
        return None if operands is None else ToolCall("add", {"a": operands[0], "b": operands[1]})

    def score(self, answer_text: str) -> float | None:
        return 1.0 if self.prompt is not None and answer_text.strip() == self.prompt.reference else 0.0
