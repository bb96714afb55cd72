"""Running each stage of a round at most once per (run, round, stage, inputs).

A flow runs its stages through a ``Stages`` object. A stage whose record exists returns the recorded
result without running; otherwise the stage runs (it is idempotent on its own commit marker, so a
crash between its commit and its record only costs re-reading what it committed), the crash-test
hook gets its chance, and the record is written. A killed campaign therefore resumes at the first
stage without a record, and re-running a flow with the same run id skips everything already done.

The inputs key is what the stage was asked to do, as its function declares it: every keyword argument
except those annotated ``NotInput`` (measurements, callbacks), with defaults applied, and of the
round context only its identity (``RoundContext.inputs``). Floats are inputs like any other value
(a sampling temperature changes what train computes). A record from other inputs is an error.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from flows.progress import stage_logger
from storage.campaigns import read_stage, write_stage
from storage.paths import StorageRoot
from tasks.config.base import AddedInput, Config, NotInput
from tasks.round.context import RoundContext
from tasks.round.faults import crash_point
from tasks.round.results import StageResult


def stage_function(task: Callable[..., Any]) -> Callable[..., Any]:
    """The plain function behind a Prefect task (or the function itself)."""
    return getattr(task, "fn", task)


def _canonical(value: Any) -> Any:
    if isinstance(value, RoundContext):
        return value.inputs()
    if isinstance(value, Config):
        return value.inputs_dump()  # without the fields that change only how fast it computes
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    raise TypeError(
        f"stage input of type {type(value).__name__} has no inputs key; pass URIs, versions, numbers or configs, "
        "or annotate the parameter NotInput"
    )


def declared_inputs(fn: Callable[..., Any]) -> tuple[list[str], type[StageResult]]:
    """(the parameters that are inputs, the result type) as ``fn`` declares them."""
    hints = typing.get_type_hints(fn, include_extras=True)
    returns = hints.get("return")
    if not (isinstance(returns, type) and issubclass(returns, StageResult)):
        raise TypeError(f"stage function {fn.__name__} must declare a StageResult return type, not {returns!r}")
    inputs = [
        name
        for name in inspect.signature(fn).parameters
        if not any(isinstance(m, NotInput) for m in getattr(hints.get(name), "__metadata__", ()))
    ]
    return inputs, returns


def inputs_key(stage: str, fn: Callable[..., Any], kwargs: dict[str, Any]) -> str:
    inputs, _ = declared_inputs(fn)
    bound = inspect.signature(fn).bind(**kwargs)  # an unknown or missing argument fails here, before anything runs
    bound.apply_defaults()
    body = [
        stage,
        {name: _canonical(bound.arguments[name]) for name in inputs if not _added_at_default(fn, name, bound)},
    ]
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]


def _added_at_default(fn: Callable[..., Any], name: str, bound: inspect.BoundArguments) -> bool:
    """Whether parameter ``name`` is an ``AddedInput`` (not keyed at its default) holding its default: left out of
    the key, so the stages a round recorded before the parameter existed still match."""
    hint = typing.get_type_hints(fn, include_extras=True).get(name)
    added = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, AddedInput)), None)
    if added is None or added.keyed_at_default:
        return False
    default = inspect.signature(fn).parameters[name].default
    return _canonical(bound.arguments[name]) == _canonical(default)


class Stages:
    """The stages of one round (``ctx.round``); ``skipped`` lists those answered from their records."""

    def __init__(self, ctx: RoundContext) -> None:
        self.ctx = ctx
        self.root = StorageRoot.of(ctx.storage)
        self.skipped: list[str] = []

    def run(self, stage: str, task: Callable[..., Any], **kwargs: Any) -> Any:
        """``task(**kwargs)`` once per inputs; returns its typed result, or the recorded one."""
        return self.submit(stage, task, _now=True, **kwargs).result()

    def submit(self, stage: str, task: Callable[..., Any], _now: bool = False, **kwargs: Any) -> PendingStage:
        """Like ``run``, but the task starts in the background (a Prefect task's ``submit``: its own
        task run beside the flow's next stages); ``result()`` waits for it and writes its record."""
        fn = stage_function(task)
        _, returns = declared_inputs(fn)
        key = inputs_key(stage, fn, kwargs)
        recorded = read_stage(self.root, self.ctx.run_id, self.ctx.round, stage, key)
        logger = stage_logger()
        if recorded is not None:
            self.skipped.append(stage)
            logger.info("round %d: %s already committed, skipped", self.ctx.round, stage)
            return PendingStage(self, stage, key, lambda: None, recorded=returns.model_validate(recorded))
        logger.info("round %d: %s started", self.ctx.round, stage)
        if _now or not hasattr(task, "submit"):
            return PendingStage(self, stage, key, lambda: task(**kwargs))
        future = task.submit(**kwargs)
        return PendingStage(self, stage, key, future.result)


class PendingStage:
    """A stage started by ``Stages.submit``: ``result()`` waits for it, then records it (once)."""

    def __init__(
        self, stages: Stages, stage: str, key: str, wait: Callable[[], Any], recorded: StageResult | None = None
    ) -> None:
        self._stages, self._stage, self._key, self._wait = stages, stage, key, wait
        self._started = time.perf_counter()
        self._result = recorded

    def result(self) -> Any:
        if self._result is None:
            stages, ctx = self._stages, self._stages.ctx
            result = self._wait()
            elapsed = time.perf_counter() - self._started
            stage_logger().info("round %d: %s done in %.1f s", ctx.round, self._stage, elapsed)
            crash_point(self._stage, ctx.round)
            write_stage(stages.root, ctx.run_id, ctx.round, self._stage, self._key, result.model_dump(mode="json"))
            self._result = result
        return self._result

    def abandon(self) -> BaseException | None:
        """Wait for a stage whose result is no longer wanted (cancelled); its error, if any, is returned."""
        try:
            self.result()
        except BaseException as exc:  # noqa: BLE001 -- handed back to the caller, who decides
            return exc
        return None
