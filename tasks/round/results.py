"""What stages hand each other: small typed records (URIs, versions, stats), never engines or tensors.

Every stage function takes keyword arguments and returns one of these. The flows read their fields by
name, and ``flows/stages.py`` stores them as a round's stage records, so a resumed round gets back the
same typed result the stage returned. A parameter annotated ``NotInput(why)`` (tasks/config/base.py) is not part of what
the stage was asked to do (a measurement, a callback, where the records live): it stays out of the
stage's resume key. Every other parameter is an input.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

Stats = dict[str, int | float | str]
"""Figures a stage reports, under their stage prefix (``rollout/``, ``train/``, ``eval/`` ...)."""


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


EVAL_PREFIX = "eval/"
"""Every held-out score and gate verdict is logged as ``eval/<field>``."""


def _eval_metrics(result: StageResult, fields: Iterable[str]) -> Stats:
    """``result``'s ``fields`` as logged metrics: booleans as 0.0/1.0, a field without a value left out."""
    values = ((name, getattr(result, name)) for name in fields)
    return {EVAL_PREFIX + name: float(v) if isinstance(v, bool) else v for name, v in values if v is not None}


class Published(StageResult):
    """A checkpoint registered in the MLflow registry (and evaluated, for the base and replays)."""

    model_version: str
    """'NAME/VERSION', or 'none' when nothing was registered."""
    stats: Stats
    accuracy: float | None = None
    """Its held-out accuracy at serving precision when this stage evaluated it (the base, as round 0; a
    replay); None otherwise."""

    @model_validator(mode="before")
    @classmethod
    def _accuracy_of_older_records(cls, data: Any) -> Any:
        # records written before the field existed held the accuracy only among the stats
        if isinstance(data, dict) and "accuracy" not in data and f"{EVAL_PREFIX}accuracy" in data.get("stats", {}):
            return {**data, "accuracy": data["stats"][f"{EVAL_PREFIX}accuracy"]}
        return data


class HeldOutScores(StageResult):
    """A checkpoint's greedy scores on the held-out prompts: on the engine and at the dtype it is served
    with, and at training precision (the same figure when those are one and the same)."""

    accuracy: float
    """Share of held-out prompts the verifier scored a success, at serving precision; what the champion
    gate and ``stop_at_accuracy`` compare."""
    prompts: int
    """Held-out prompts scored."""
    infra_failures: int
    """Prompts the verifier could not score (counted as not a success)."""
    mean_tokens: float
    """Mean greedy answer length in tokens, at serving precision."""
    engine: str
    """Serving engine the accuracy was measured on."""
    dtype: str
    """Serving precision the accuracy was measured at."""
    accuracy_train_precision: float
    """Accuracy on the embedded engine at training precision."""
    serving_gap: float
    """``accuracy`` less ``accuracy_train_precision``."""

    def metrics(self) -> Stats:
        """The ``eval/`` figures logged to MLflow."""
        return _eval_metrics(self, HeldOutScores.model_fields)


class Evaluation(HeldOutScores):
    """The evaluate stage: a checkpoint's held-out scores and the champion gate's verdict on them."""

    champion_accuracy: float | None = None
    """The champion's accuracy at the same engine and dtype; None when there was no other champion."""
    promoted: bool
    """The champion alias moved to this checkpoint."""
    gate_passed: bool
    """Its accuracy was not below the champion's (promoted unless a person has to approve)."""
    approved: bool | None = None
    """A person's decision (``evaluate.approval: required``); None when nobody was asked."""

    @model_validator(mode="before")
    @classmethod
    def _fields_of_older_records(cls, data: Any) -> Any:
        # records written before these results were typed held {"stats": {"eval/<field>": value}}
        if isinstance(data, dict) and set(data) == {"stats"}:
            return {key.removeprefix(EVAL_PREFIX): value for key, value in data["stats"].items()}
        return data

    def metrics(self) -> Stats:
        """The ``eval/`` figures logged to MLflow, the gate's verdict among them."""
        return _eval_metrics(self, Evaluation.model_fields)

    def decided(self, promotion: Promotion) -> Evaluation:
        """This evaluation once a person has decided on the promotion."""
        return self.model_copy(update={"promoted": promotion.approved, "approved": promotion.approved})


class Promotion(StageResult):
    """A person's decision on promoting a checkpoint that passed the gate (the promote stage)."""

    approved: bool
    """Approved, and so promoted; a rejection or no answer in time is False."""

    @model_validator(mode="before")
    @classmethod
    def _fields_of_older_records(cls, data: Any) -> Any:
        # records written before this result was typed held {"stats": {"eval/promoted": x, "eval/approved": x}}
        if isinstance(data, dict) and set(data) == {"stats"}:
            return {"approved": data["stats"][f"{EVAL_PREFIX}approved"]}
        return data

    def metrics(self) -> Stats:
        """The ``eval/`` figures logged to MLflow: the promotion, and the decision that made it."""
        return {f"{EVAL_PREFIX}promoted": float(self.approved), f"{EVAL_PREFIX}approved": float(self.approved)}


class VersionEvaluation(HeldOutScores):
    """A registered model version scored again (``rlrounds eval``)."""

    model_version: str
    checkpoint: str
    train_dtype: str


class RoundRecord(StageResult):
    """A round's metrics logged and its MLflow run closed."""

    report: str
    """The round health report (markdown)."""
