"""Running each stage of a round at most once per (run, round, stage, inputs).

A flow runs its stages through a ``Stages`` object. A stage whose record exists returns the recorded
result without running; otherwise the stage runs (it is idempotent on its own commit marker, so a
crash between its commit and its record only costs re-reading what it committed), the crash-test
hook gets its chance, and the record is written. A killed campaign therefore resumes at the first
stage without a record, and re-running a flow with the same run id skips everything already done.

The inputs key is what the stage was asked to do: the round's identity, its configs, and upstream
URIs and versions. Measurements (floats, stats dicts) and per-process ids (Prefect flow run, code
version) are not inputs, so a resumed stage matches its record; a record from other inputs is an error.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

from pydantic import BaseModel

from storage.campaigns import read_stage, write_stage
from storage.paths import StorageRoot
from tasks.context import RoundContext
from tasks.faults import crash_point

# Per process, not per campaign: a resume may run other code (a bug fix) in another Prefect flow run,
# and the MLflow run is found again by its tags. The storage root is where the records live.
NOT_INPUTS = {"flow_run_id", "code_version", "mlflow_run_id", "storage"}


def _canonical(value: Any) -> Any:
    if isinstance(value, RoundContext):
        return value.model_dump(mode="json", exclude=NOT_INPUTS)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if value is None or isinstance(value, (float, dict)):
        return "~"  # a measurement, or absent: keeps the other arguments in place
    if isinstance(value, (str, int, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    raise TypeError(f"stage argument of type {type(value).__name__} has no inputs key; pass URIs, versions or configs")


def inputs_key(stage: str, args: tuple, kwargs: dict) -> str:
    body = [stage, [_canonical(a) for a in args], {k: _canonical(v) for k, v in sorted(kwargs.items())}]
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]


class Stages:
    """The stages of one round (``ctx.round``); ``skipped`` lists those answered from their records."""

    def __init__(self, ctx: RoundContext) -> None:
        self.ctx = ctx
        self.root = StorageRoot.of(ctx.storage)
        self.skipped: list[str] = []

    def run(self, stage: str, task: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        key = inputs_key(stage, args, kwargs)
        record = read_stage(self.root, self.ctx.run_id, self.ctx.round, stage, key)
        if record is not None:
            self.skipped.append(stage)
            return record["value"]
        value = task(*args, **kwargs)
        crash_point(stage, self.ctx.round)
        write_stage(self.root, self.ctx.run_id, self.ctx.round, stage, key, {"value": value})
        return value
