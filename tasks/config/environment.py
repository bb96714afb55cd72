"""The episode section of an agentic round (``round.environment`` set): the episode's budgets and the warm pool of
tool sandboxes.

Light (pydantic only), like every config module. tasks/environments/ and the rollout and evaluate stages read these
(docs/environments.md).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field, model_validator

from tasks.config.base import Config, NotInput
from tasks.config.verify import SandboxLimits


class EpisodeBudget(Config):
    """What one episode may spend. A budget the model exhausts by its own choices (too many turns, too many
    tokens, too many tool calls' seconds) ends the episode as a model failure; a single tool step that hangs past
    ``step_timeout_s`` is an infrastructure failure of that step (docs/environments.md)."""

    model_config = ConfigDict(frozen=True)

    max_turns: int = Field(8, ge=1, le=1024)
    """Policy turns an episode may take (each turn: the model's text up to a stop, then the environment's answer).
    An episode still unfinished after this many turns is a model failure."""
    max_tokens: int = Field(512, ge=1, le=1 << 20)
    """Policy tokens an episode may sample over all its turns (observations not counted); one turn also stops at
    the remaining budget. Exhausted before the episode is done: a model failure."""
    max_tool_seconds: float = Field(60.0, gt=0.0, le=86_400.0)
    """Seconds of environment steps (tool calls) an episode may spend in all; exhausted: a model failure (the
    model chose the calls), unless the last step itself hung past ``step_timeout_s``."""
    step_timeout_s: float = Field(10.0, gt=0.0, le=3600.0)
    """Seconds one environment step (a tool call in its sandbox) may take before it is stopped and recorded as an
    infrastructure failure of that step: a hung or crashed tool is the environment's fault, never a zero reward."""

    @model_validator(mode="after")
    def _timeout_within_budget(self) -> EpisodeBudget:
        if self.step_timeout_s > self.max_tool_seconds:
            raise ValueError(
                f"step_timeout_s={self.step_timeout_s} exceeds max_tool_seconds={self.max_tool_seconds}: one step "
                "could never use its whole timeout; lower step_timeout_s or raise max_tool_seconds"
            )
        return self


class ToolPoolConfig(Config):
    """The warm pool of tool sandboxes, sized independently of the engine (tasks/environments/tool_pool.py)."""

    model_config = ConfigDict(frozen=True)

    sandboxes: Annotated[int, NotInput("how many calls run at once: speed and memory, never what is computed")] = Field(
        4, ge=1, le=1024
    )
    """Pre-started sandboxes (each a contained interpreter with the tools already loaded). Tool calls beyond this
    many at once wait for one, and the wait is recorded. Changes speed and memory only, never what is computed."""
    warm: Annotated[bool, NotInput("a warm or a cold start of the same sandbox: speed only")] = True
    """Keep sandboxes started between calls and fork a fresh process per call from the pre-loaded template (True),
    or start a cold sandbox per call (False: the baseline benchmarks/episodes.py compares against). Changes speed
    only, never what is computed."""
    limits: SandboxLimits = SandboxLimits(wall_timeout_s=30.0, cpu_time_s=30)
    """Resource limits of each sandbox; a call's own wall clock is the episode's ``step_timeout_s``."""


class EpisodeConfig(Config):
    """How an agentic round's episodes run (``round.environment`` names the environment)."""

    budget: EpisodeBudget = EpisodeBudget()
    """What one episode may spend: turns, policy tokens, tool seconds, and one step's timeout. rollout.max_tokens
    is one turn's limit; budget.max_tokens the whole episode's."""
    tools: ToolPoolConfig = ToolPoolConfig()
    """The warm pool of tool sandboxes, sized independently of the engine."""
    env_workers: Annotated[int, NotInput("threads that run environment steps: speed only")] = Field(32, ge=1, le=4096)
    """Environment steps (tool calls) in flight at once while the engine keeps decoding other episodes."""
