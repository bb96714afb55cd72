"""The prompts section: where training prompts come from and how the curriculum draws them."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from models.builtin import BUILTIN_SOURCES
from tasks.config.base import Config

BUILTIN = "builtin:addition"


class PromptsConfig(Config):
    """Where training prompts come from."""

    source: str = BUILTIN
    """'builtin:addition', 'builtin:longtail' (count down: long-tailed answer lengths), or a local/remote
    path to a .parquet or .jsonl file with columns prompt, reference."""
    task: str = "addition"
    """Task name recorded on every row; also selects the verifier unless verify.verifier is set."""
    solved_weight: float = Field(0.2, gt=0.0, le=1.0)
    """Curriculum (tasks/curriculum.py): the probability of drawing a prompt whose most recent group, within the
    last history_rounds rounds, fully succeeded (such groups mostly have zero advantage). 1 draws every prompt. Rows
    record it as prompt_weight."""
    history_rounds: int = Field(16, ge=1)
    """Committed rounds of this campaign that the curriculum looks back over."""

    @field_validator("source")
    @classmethod
    def _known_format(cls, v: str) -> str:
        if v not in BUILTIN_SOURCES and not v.endswith((".parquet", ".jsonl")):
            raise ValueError(
                f"prompt source {v!r} must be one of {', '.join(map(repr, BUILTIN_SOURCES))} "
                "or a .parquet / .jsonl file"
            )
        return v

    @model_validator(mode="after")
    def _builtin_task_matches(self) -> PromptsConfig:
        builtin = BUILTIN_SOURCES.get(self.source)
        if builtin and self.task != builtin.task:
            raise ValueError(
                f"prompts.source {self.source!r} is the {builtin.task!r} task; set prompts.task to {builtin.task!r}"
            )
        return self
