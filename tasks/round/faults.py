"""Crash injection for resume tests: inert unless ``RLROUNDS_CRASH_AFTER`` is set.

    RLROUNDS_CRASH_AFTER=train:1            SIGKILL this process right after round 1's train stage
    RLROUNDS_CRASH_AFTER=rollout:2,base:0   the first of these points reached

The flow calls ``crash_point(stage, round)`` after each stage has committed its output and before
the stage's record is written, so a resume exercises the stage's own idempotency (the harder path).
SIGKILL, not an exception: no ``finally`` runs, no buffer is flushed, exactly like a lost machine.
"""

from __future__ import annotations

import os
import signal
import sys

CRASH_ENV = "RLROUNDS_CRASH_AFTER"


def crash_points(spec: str | None) -> set[tuple[str, int]]:
    """'train:1,rollout:2' -> {('train', 1), ('rollout', 2)}; malformed items are an error, not ignored."""
    points = set()
    for item in filter(None, (part.strip() for part in (spec or "").split(","))):
        stage, sep, round_text = item.rpartition(":")
        if not sep or not stage or not round_text.isdigit():
            raise ValueError(f"{CRASH_ENV} item {item!r} must be STAGE:ROUND, e.g. train:1")
        points.add((stage, int(round_text)))
    return points


def crash_point(stage: str, round_index: int) -> None:
    spec = os.environ.get(CRASH_ENV)
    if spec and (stage, round_index) in crash_points(spec):
        sys.stderr.write(f"rlrounds: injected crash after {stage}:{round_index} (pid {os.getpid()})\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
