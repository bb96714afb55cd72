"""What an environment is, what one step returns, and how an episode's outcome is decided.

An environment answers the policy turn by turn (docs/environments.md):

    reset(prompt)       -> Observation        the task as the policy first reads it (its tools are shown with it)
    step(action_text)   -> StepResult         the environment's answer to one policy turn: the next observation,
                                              whether the episode is done, and its reward once it is (None: cannot
                                              score); infra_error when the step failed on the environment's side
    close()                                   release what it holds

The action is text because environments read text; the tokens the policy sampled are kept by the runner as they
were sampled, whatever the text decodes to. ``ToolEnvironment`` is the base most environments need: it reads a
tool call out of the action, runs it in the warm sandbox pool, and scores the final answer.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from models.prompt import Prompt
from tasks.environments.tool_pool import ToolPool
from tasks.environments.tools import Tool, ToolCall, ToolCallError, parse_tool_call
from tasks.verifiers.outcome import Outcome

OBSERVATION_PLAIN = "\n[tool] {text}\n"
"""How a tool's answer is shown to a model without a chat template, unless its environment says otherwise."""


@dataclass(frozen=True)
class Observation:
    """What the environment shows the policy: the first user turn (``reset``) or a tool's answer (``step``)."""

    text: str
    system: str | None = None
    """A system turn to render before the first observation (``reset`` only), e.g. the answer format."""


@dataclass(frozen=True)
class StepResult:
    observation: Observation
    done: bool
    reward: float | None = None
    """Set once ``done``: in [0, 1]; None when the environment cannot score the episode (outcome unknown)."""
    infra_error: str | None = None
    """Why the step failed on the environment's side (a tool that crashed or hung, no sandbox): the episode ends
    as an infrastructure failure and never becomes a zero reward."""
    tool_seconds: float = 0.0
    """Seconds the step spent in tools (counted against the episode's ``max_tool_seconds``)."""


@dataclass(frozen=True)
class PlainFormat:
    """How an environment's episodes are written for a model without a chat template (a character-level policy,
    say, whose alphabet has no room for a tool list or JSON). A model with a chat template reads the template's
    format and none of this."""

    show_tools: bool = True
    """List the tools before the first observation (False: the task's text is the whole prompt)."""
    observation: str = OBSERVATION_PLAIN
    """A tool's answer as appended after a policy turn (``str.format`` with ``text``)."""
    stop: tuple[str, ...] = ()
    """Strings that end a policy turn besides end-of-sequence (the end of a tool call, say): the runner adds them
    to the episode's stop strings."""


@runtime_checkable
class Environment(Protocol):
    tools: Sequence[Tool]
    """The tools the policy is shown (rendered into its prompt)."""
    plain_format: PlainFormat
    """How episodes are written for a model without a chat template (optional: ``PlainFormat()``, the tools listed
    and a tool's answer as ``OBSERVATION_PLAIN``, when an environment leaves it out)."""

    def reset(self, prompt: Prompt) -> Observation: ...

    def step(self, action_text: str, *, timeout_s: float) -> StepResult:
        """Answer one turn within ``timeout_s`` seconds (the episode's step timeout)."""
        ...

    def close(self) -> None: ...


EnvironmentFactory = Callable[[ToolPool], Environment]
"""Makes one episode's environment; the pool is shared by every episode of the round (``round.environment`` names
a class or function of this shape, ``my_pkg.my_env:MyEnv``)."""


def load_environment(spec: str) -> EnvironmentFactory:
    """The environment named ``module.path:Name`` (``round.environment``): a class or function called with the tool
    pool for each episode."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"environment {spec!r} is not 'package.module:Name'; e.g. 'my_pkg.my_env:MyEnv'")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"environment {spec!r} cannot be loaded ({exc}); is its package importable here?") from exc
    if not callable(factory):
        raise ValueError(f"environment {spec!r} is not a class or function")
    return factory


class ToolEnvironment(ABC):
    """An environment whose policy calls tools and then answers: subclasses set ``tool_functions`` and define
    ``reset`` and ``score``. A turn with a tool call runs it in the pool; a turn without one is the final answer.
    A call is read by ``parse_call`` (the ``<tool_call>`` JSON form unless a subclass reads its own).

    A tool that raised is shown to the policy (``Error: ...``) and the episode goes on: its arguments were the
    model's. A tool whose process crashed or hung is an infrastructure failure of the step."""

    tool_functions: Sequence[Callable] = ()
    plain_format: PlainFormat = PlainFormat()

    def __init__(self, pool: ToolPool) -> None:
        self.pool = pool
        self.tools = [Tool.from_function(f) for f in self.tool_functions]
        self.prompt: Prompt | None = None

    def reset(self, prompt: Prompt) -> Observation:
        self.prompt = prompt
        return Observation(prompt.text)

    @abstractmethod
    def score(self, answer_text: str) -> float | None:
        """The reward of the final answer (a turn without a tool call); None: it cannot be scored."""

    def parse_call(self, action_text: str) -> ToolCall | None:
        """The tool call in a policy turn, None when the turn is the final answer; raises ``ToolCallError`` for a
        call that cannot be read (shown to the policy, which may try again)."""
        return parse_tool_call(action_text)

    def step(self, action_text: str, *, timeout_s: float) -> StepResult:
        try:
            call = self.parse_call(action_text)
        except ToolCallError as exc:
            return StepResult(Observation(f"Error: {exc}"), done=False)
        if call is None:
            return StepResult(Observation(""), done=True, reward=self.score(action_text))
        reply = self.pool.call(call.name, call.arguments, timeout_s=timeout_s)
        if reply.infra is not None:
            return StepResult(Observation(""), done=True, infra_error=reply.infra, tool_seconds=reply.seconds)
        return StepResult(Observation(reply.text), done=False, tool_seconds=reply.seconds)

    def close(self) -> None:  # noqa: B027 -- most environments hold nothing beyond the shared pool
        """Release what the episode holds (nothing here: the tool pool is shared and closed by its owner)."""


# -- the outcome of an episode ------------------------------------------------------------------------


@dataclass(frozen=True)
class EpisodeOutcome:
    outcome: Outcome
    reward: float | None
    error: str | None = None


def episode_outcome(
    *, done: bool, reward: float | None, infra_error: str | None, exhausted: str | None
) -> EpisodeOutcome:
    """The failure taxonomy, per episode, in the order the rules apply:

    infra_error set           infra_failure, reward None: the environment failed; never a zero in the gradient
    exhausted set             model_failure, reward 0: a budget (turns, tokens, tool seconds) the model's own
                              choices spent before it answered
    done, reward None         unknown: the environment could not score the answer
    done, reward > 0          success, the reward
    done, reward 0            model_failure, 0
    not done                  unknown (the runner never leaves an episode so; a guard, not a rule)
    """
    if infra_error is not None:
        return EpisodeOutcome(Outcome.INFRA_FAILURE, None, infra_error)
    if exhausted is not None:
        return EpisodeOutcome(Outcome.MODEL_FAILURE, 0.0, exhausted)
    if not done or reward is None:
        return EpisodeOutcome(Outcome.UNKNOWN, None, None if done else "the episode did not finish")
    if reward > 0:
        return EpisodeOutcome(Outcome.SUCCESS, reward)
    return EpisodeOutcome(Outcome.MODEL_FAILURE, reward)
