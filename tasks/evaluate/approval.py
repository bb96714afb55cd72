"""Promotion with a person in the loop (``evaluate.approval: required``).

A round whose checkpoint passed the champion gate pauses after evaluation; the flow shows what a
person needs to decide (``approval_markdown``: serving- vs training-precision accuracy, beside the
champion's) and waits for an answer in the Prefect UI. ``run_decide_promotion`` then moves the
champion alias on an approval and records the decision on the model version either way; no answer
before the timeout is a rejection.
"""

from __future__ import annotations

from storage.model_versions import parse_model_version
from storage.paths import StorageRoot
from storage.settings import settings
from storage.tracking import Tracker
from tasks.config.evaluate import EvaluateConfig
from tasks.evaluate.gate import PROMOTED_TAG
from tasks.publish.describe import describe_version
from tasks.round.context import RoundContext
from tasks.round.results import Evaluation, Promotion

APPROVAL_TAG = "eval.approval"  # approved | rejected | timed_out


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def approval_markdown(model_version: str, champion: str | None, evaluation: Evaluation, timeout_s: int) -> str:
    """What the approver reads: the candidate's accuracy at serving and training precision and the
    champion's at the same serving engine and precision."""
    where = f"{evaluation.engine}, {evaluation.dtype}"
    return "\n".join(
        [
            f"# Promote {model_version} to champion?",
            "",
            "| | serving precision | training precision |",
            "| --- | --- | --- |",
            f"| candidate {model_version} | {_percent(evaluation.accuracy)} ({where}) "
            f"| {_percent(evaluation.accuracy_train_precision)} |",
            f"| champion {champion or '(none yet)'} | {_percent(evaluation.champion_accuracy)} ({where}) | |",
            "",
            f"Held-out prompts: {evaluation.prompts}. Approve to move the champion alias; reject to leave "
            f"it. No answer within {timeout_s} s rejects.",
            "",
        ]
    )


def run_decide_promotion(*, ctx: RoundContext, config: EvaluateConfig, model_version: str, decision: str) -> Promotion:
    """Apply a person's decision ('approved', 'rejected' or 'timed_out') to the champion alias and
    record it on the model version (``eval.approval``, ``eval.promoted``)."""
    if decision not in ("approved", "rejected", "timed_out"):
        raise ValueError(f"decision {decision!r} must be approved, rejected or timed_out")
    root = StorageRoot.of(ctx.storage)
    tracker = Tracker.connect(settings(), root)
    name, version = parse_model_version(model_version)
    promoted = decision == "approved"
    if promoted:
        tracker.set_alias(name, config.champion_alias, version)
    tracker.tag_model_version(name, version, {APPROVAL_TAG: decision, PROMOTED_TAG: float(promoted)})
    describe_version(tracker, root, model_version)
    return Promotion(approved=promoted)
