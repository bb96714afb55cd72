"""What stages hand each other: small typed records (URIs, versions, stats), never engines or tensors.

Every stage function takes keyword arguments and returns one of these. The flows read their fields by
name, and ``flows/stages.py`` stores them as a round's stage records, so a resumed round gets back the
same typed result the stage returned. A parameter annotated ``NotInput(why)`` is not part of what the
stage was asked to do (a measurement, a callback, where the records live): it stays out of the
stage's resume key. Every other parameter is an input.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

Stats = dict[str, int | float | str]
"""Figures a stage reports, under their stage prefix (``rollout/``, ``train/``, ``eval/`` ...)."""


@dataclass(frozen=True)
class NotInput:
    """Marks a stage parameter that stays out of its resume key: ``Annotated[dict, NotInput("why")]``."""

    why: str


class StageResult(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BasePolicy(StageResult):
    """The starting policy of a campaign."""

    checkpoint: str
    """URI of its committed checkpoint (or the user's local directory)."""
    base_model: str
    """Its identity, recorded as every checkpoint's base_model tag."""
    built: bool
    """Built by this call (the built-in recipe), rather than found."""


class RoundRuns(StageResult):
    """The MLflow runs a round logs to."""

    campaign_run: str
    round_run: str
    experiment_id: str


class Checked(StageResult):
    """What the input checks looked at (for the log)."""

    stats: Stats


class Staged(StageResult):
    """A round's generated and verified samples, staged as Parquet but not yet committed."""

    staging: str | None
    """The staged file; None when the round's trajectory version was already committed."""
    stats: Stats
    carryover: str | None = None
    """The staged carry-over (unfinished samples the next round resumes, Parquet); None when nothing
    was staged (a round found committed: its carry-over is committed with its version)."""
    resumed: bool = False


class TrajectoryVersion(StageResult):
    """A committed trajectory version."""

    version: str
    uri: str
    stats: Stats
    parent: str | None = None
    """The version it was derived from (re-filtered versions); None for a round's own."""
    resumed: bool = False


class Reverified(TrajectoryVersion):
    """A derived version whose selected rows were verified again (``rlrounds reverify``)."""

    rows: int
    """How many rows were verified again."""
    verifier: dict[str, str]
    """The verifier that scored them: its name and version."""
    outcomes_before: dict[str, int]
    """Their outcomes as stored in the parent version."""
    outcomes_after: dict[str, int]
    """Their outcomes now."""


class Trained(StageResult):
    """A committed checkpoint trained on one trajectory version."""

    checkpoint: str
    stats: Stats
    committed_at: float | None
    """When it was committed (start of the publish latency); None when found committed."""
    resumed: bool = False


class Published(StageResult):
    """A checkpoint registered in the MLflow registry (and evaluated, for the base and replays)."""

    model_version: str
    """'NAME/VERSION', or 'none' when nothing was registered."""
    stats: Stats


class Evaluation(StageResult):
    """A checkpoint's held-out scores at serving and training precision (``eval/`` stats)."""

    stats: Stats


class VersionEvaluation(StageResult):
    """A registered model version scored again (``rlrounds eval``)."""

    model_version: str
    checkpoint: str
    train_dtype: str
    stats: Stats


class RoundRecord(StageResult):
    """A round's metrics logged and its MLflow run closed."""

    report: str
    """The round health report (markdown)."""
