"""The publish section: where checkpoints are registered and the promotion line they belong to."""

from __future__ import annotations

import hashlib
import posixpath
import re

from pydantic import field_validator

from tasks.config.base import Config


class PublishConfig(Config):
    """Where checkpoints are registered, and which promotion line they belong to."""

    model_name: str | None = None
    """Registered model name in the MLflow registry. Default: 'rlrounds-<line>', one registered model (and
    so one champion) per promotion line."""
    line: str | None = None
    """Promotion line: the checkpoints the champion gate compares, all evaluated on one task and held-out
    set. Default: the prompts' task ('addition', 'longtail'), followed by the held-out file's name and a
    hash of its URI when evaluate.source is set ('addition-heldout-1a2b3c4d')."""
    register_base: bool = True
    """Register the starting policy as version 'round 0', so every lineage walk ends at a registered base."""

    @field_validator("model_name")
    @classmethod
    def _no_slash(cls, v: str | None) -> str | None:
        if v is not None and (not v or "/" in v or "'" in v):
            raise ValueError(f"model_name {v!r} must be non-empty without '/' or quotes (lineage uses NAME/VERSION)")
        return v

    @field_validator("line")
    @classmethod
    def _line_safe(cls, v: str | None) -> str | None:
        if v is not None and not LINE_PATTERN.match(v):
            raise ValueError(
                f"publish.line {v!r} must be 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return v

    def resolved(self, task: str, held_out_source: str | None) -> PublishConfig:
        """This section with its line and model name filled in (RoundConfig.publish_resolved calls it)."""
        line = self.line or promotion_line(task, held_out_source)
        return self.model_copy(update={"line": line, "model_name": self.model_name or f"{DEFAULT_NAME_PREFIX}{line}"})

    @property
    def registered_name(self) -> str:
        if self.model_name is None or self.line is None:
            raise ValueError("publish needs its line and model name resolved; pass RoundConfig.publish_resolved")
        return self.model_name


DEFAULT_NAME_PREFIX = "rlrounds-"
LINE_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def promotion_line(task: str, held_out_source: str | None) -> str:
    """The line of a campaign that trains on ``task`` and is evaluated on ``held_out_source`` (None: the
    built-in task's fixed held-out set, which the task name already identifies).

    A held-out file is named by its stem and a hash of its URI, so two files that share a name are two
    lines, while a line name stays readable in the registry."""
    line = _slug(task, 60) or "task"
    if held_out_source:
        stem = posixpath.basename(held_out_source.rstrip("/")).rsplit(".", 1)[0]
        digest = hashlib.sha256(held_out_source.encode()).hexdigest()[:8]
        line = f"{line}-{_slug(stem, 30) or 'heldout'}-{digest}"
    return line


def _slug(text: str, limit: int) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:limit]
