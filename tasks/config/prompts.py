"""The prompts section: where training prompts come from and how the curriculum draws them."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator

from models.builtin import BUILTIN_SOURCES
from tasks.config.base import AddedInput, Config

BUILTIN = "builtin:addition"


class PromptsConfig(Config):
    """Where training prompts come from."""

    source: str = BUILTIN
    """'builtin:addition', 'builtin:longtail' (count down: long-tailed answer lengths), or a local/remote
    path to a .parquet or .jsonl file with a prompt column and a reference column (prompt_column, reference_column)."""
    task: str = "addition"
    """Task name recorded on every row; also selects the verifier unless verify.verifier is set."""
    solved_weight: float = Field(0.2, gt=0.0, le=1.0)
    """Curriculum (tasks/rollout/curriculum.py): the probability of drawing a prompt whose most recent group, within the
    last history_rounds rounds, fully succeeded (such groups mostly have zero advantage). 1 draws every prompt. Rows
    record it as prompt_weight."""
    history_rounds: int = Field(16, ge=1)
    """Committed rounds of this campaign that the curriculum looks back over."""
    prompt_column: Annotated[str, AddedInput(since="2026-12")] = "prompt"
    """A file's column holding each prompt: a string, or chat turns (a list of {role, content}). Default 'prompt',
    or 'messages' in a file without a 'prompt' column. A dotted path (a.b) reaches a nested field."""
    reference_column: Annotated[str, AddedInput(since="2026-12")] = "reference"
    """A file's column holding each reference answer (or tests) the verifier scores against; a dotted path (a.b)
    reaches a nested field."""
    chat_template: Annotated[bool, AddedInput(since="2026-12")] = False
    """Render string prompts as a user turn through the base tokenizer's chat template, with the generation prompt.
    Chat-turn prompts always are. Rows store the rendered text and its token ids."""
    system_prompt: Annotated[str | None, AddedInput(since="2026-12")] = None
    """With chat_template: a system turn put before each prompt's turns (unless they open with their own)."""

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

    @model_validator(mode="after")
    def _chat_needs_a_file(self) -> PromptsConfig:
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("prompts.system_prompt is written by the chat template; set prompts.chat_template: true")
        if self.chat_template and self.source in BUILTIN_SOURCES:
            raise ValueError(
                f"prompts.source {self.source!r} is plain text for a tokenizer without a chat template; set "
                "prompts.chat_template: false, or prompts.source to a .jsonl or .parquet file"
            )
        return self
