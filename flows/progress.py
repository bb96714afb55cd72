"""What a person watching a flow run in the Prefect UI sees while it runs.

- ``StageProgress``: a progress artifact and throttled log lines for a long stage (the base build,
  a round's rollout), fed by the stage's own progress messages ("... step 120/250 ...").
- ``publish_rounds_table``: a campaign's table artifact (accuracy, reward, kept groups, seconds per
  round), published again after every round under one key, so the UI shows its latest state.
- ``stage_logger``: the flow run's logger when one is running, for stage start and end lines.

Artifacts are a view: a failure to create one is logged and never stops the flow (the figures are in
MLflow and the trajectory store already).
"""

from __future__ import annotations

import logging
import re
import threading
import time

from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger

from tasks.round.report import report_progress

log = logging.getLogger("rlrounds")
_FRACTION = re.compile(r"(\d+)/(\d+)")


def stage_logger() -> logging.Logger | logging.LoggerAdapter:
    """The running flow's logger (its lines appear in the flow run's log in the UI), else rlrounds'."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("rlrounds.progress")  # the CLI's progress line, not its result lines


def artifact_key(*parts: object) -> str:
    """A Prefect artifact key: lowercase letters, digits and dashes."""
    text = "-".join(str(p) for p in parts).lower()
    return re.sub(r"-+", "-", "".join(c if c.isalnum() else "-" for c in text)).strip("-")


class StageProgress:
    """A progress callback for a stage: updates one progress artifact from the 'N/M' in each message
    (at most every ``every_s``) and logs the message to the flow run (at most every ``log_every_s``).

    Called from the stage's worker threads, so the artifact calls are serialized by a lock."""

    def __init__(self, stage: str, key: str, description: str, every_s: float = 2.0, log_every_s: float = 10.0):
        self.stage, self.key, self.description = stage, key, description
        self.every_s, self.log_every_s = every_s, log_every_s
        self.logger = stage_logger()
        self._lock = threading.Lock()
        self._artifact_id = None
        self._last_update = self._last_log = 0.0
        self._failed = False

    def __call__(self, message: str) -> None:
        report_progress(message)  # the terminal's progress line (the CLI), as before
        now = time.monotonic()
        with self._lock:
            if now - self._last_log >= self.log_every_s:
                self._last_log = now
                self.logger.info("%s", message)
            match = _FRACTION.search(message)
            if match and int(match[2]) > 0 and now - self._last_update >= self.every_s:
                self._last_update = now
                self._set(min(100.0, 100.0 * int(match[1]) / int(match[2])))

    def done(self) -> None:
        """The stage finished: 100% (the artifact is created now if no message came before)."""
        with self._lock:
            self._set(100.0)

    def _set(self, percent: float) -> None:
        if self._failed:
            return

        try:
            if self._artifact_id is None:
                self._artifact_id = create_progress_artifact(
                    progress=percent, key=self.key, description=self.description
                )
            else:
                update_progress_artifact(self._artifact_id, progress=percent)
        except Exception as exc:  # noqa: BLE001 -- a view; the stage goes on without it
            self._failed = True
            log.warning("could not update the %s progress artifact: %s", self.stage, exc)


def rounds_table(history: list[dict]) -> list[dict]:
    """One row per finished round, the figures a person scans first (round 0 is the base)."""
    rows = []
    for entry in history:
        rows.append(
            {
                "round": entry["round"],
                "model version": entry.get("model_version", ""),
                "held-out accuracy": f"{entry['accuracy']:.1%}",
                "mean reward": _figure(entry.get("reward"), ".3f"),
                "kept groups": _figure(entry.get("kept_groups"), ".0f"),
                "seconds": _figure(entry.get("seconds"), ".1f"),
            }
        )
    return rows


def _figure(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def publish_rounds_table(run_id: str, history: list[dict]) -> None:
    """The campaign's rounds so far as a table artifact (a new version of one key per round)."""
    try:
        create_table_artifact(
            table=rounds_table(history),
            key=artifact_key("campaign", run_id, "rounds"),
            description=f"campaign {run_id}: one row per round, updated after every round",
        )
    except Exception as exc:  # noqa: BLE001 -- a view; the campaign goes on without it
        log.warning("could not publish the rounds table artifact: %s", exc)
