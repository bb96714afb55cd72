"""Overlap mode (``round.mode: overlap``): round k+1's rollout runs while round k trains.

The hand-over is a ``NextPolicy``. Round k's flow submits round k+1's rollout right after round k's
trajectories are committed, on the engine as it is (serving round k-1's policy, the newest committed),
and gives it a ``NextPolicy`` for round k's checkpoint. When train commits that checkpoint the flow calls
``committed()``; the engine loads it between two decode steps once the rollout has finished
``after_samples`` samples (``models/engines/embedded.py``, ``WeightUpdate``), waiting there if training is late.
Tokens sampled before the update carry version k-1, those after it version k, and round k+1 trains at
version k: a lag of at most one version, measured per token (``train/lag_versions_*``) and corrected by the
loss's truncated importance weights against the recorded behaviour logprobs.

Why a count of finished samples and not "as soon as training is done": the rows of a round must not
depend on how fast the trainer happened to be, or a killed campaign could not resume to the result of an
uninterrupted one, and a replay could not be checked against the original. The price is that the engine
can wait for the trainer (``rollout/weight_update_wait_s``, the generator's idle time) or run on with the
older weights for a while after they are ready (``rollout/weight_update_lag_s``): ``round.overlap_update_after``
places the point.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from storage import checkpoints
from storage.paths import StorageRoot


class RolloutCancelled(RuntimeError):
    """The round that was to hand over its weights failed or the campaign stopped: the rollout ran for nothing."""


@dataclass
class UpdateAtStep:
    """A ``WeightUpdate`` due at the engine's ``step``-th poll, one poll per decode step: new weights at a
    known point of a generation, for benchmarks and tests (a round's hand-over is ``NextPolicy``)."""

    directory: str
    version: int
    step: int
    polls: int = 0
    pause_s: float | None = None

    def due(self, finished: int) -> bool:
        self.polls += 1
        return self.polls >= self.step

    def take(self) -> tuple[str, int]:
        return self.directory, self.version

    def applied(self, pause_s: float) -> None:
        self.pause_s = pause_s


class NextPolicy:
    """The checkpoint a running rollout switches to, once it is committed and the update point is reached."""

    def __init__(self, storage: str, checkpoint: str, version: int, after_samples: int) -> None:
        self.storage, self.checkpoint, self.version = storage, checkpoint, version
        self.after_samples = after_samples
        self._ready = threading.Event()
        self._cancelled: str | None = None
        self.committed_at: float | None = None
        self.due_at: float | None = None
        self.applied_at: float | None = None
        self.wait_s = 0.0
        self.pause_s = 0.0

    # -- the trainer's side ----------------------------------------------------------------------

    def committed(self) -> None:
        """The checkpoint is committed: the engine may load it."""
        self.committed_at = self.committed_at or time.time()
        self._ready.set()

    def cancel(self, why: str) -> None:
        """The checkpoint will not come: the rollout stops at its next decode step, or where it waits."""
        self._cancelled = why
        self._ready.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled is not None

    @property
    def cancel_reason(self) -> str:
        return self._cancelled or ""

    # -- the engine's side (models.engines.types.WeightUpdate) ------------------------------------------

    def due(self, finished: int) -> bool:
        return finished >= self.after_samples

    def take(self) -> tuple[str, int]:
        self.due_at = time.time()
        self._ready.wait()
        self.wait_s = time.time() - self.due_at
        if self._cancelled is not None:
            raise RolloutCancelled(self._cancelled)
        return checkpoints.local_copy(StorageRoot.of(self.storage), self.checkpoint), self.version

    def applied(self, pause_s: float) -> None:
        self.applied_at, self.pause_s = time.time(), pause_s

    def stats(self) -> dict[str, float]:
        """What the update cost: the engine's wait for the trainer, its pause, and how long the committed
        weights waited for the update point (all 0 when the rollout ended before the point)."""
        applied = self.applied_at is not None
        return {
            "rollout/weight_update_applied": float(applied),
            "rollout/weight_update_after_samples": float(self.after_samples),
            "rollout/weight_update_wait_s": self.wait_s,
            "rollout/weight_update_pause_s": self.pause_s,
            "rollout/weight_update_lag_s": (
                max(0.0, (self.due_at or 0.0) - self.committed_at) if applied and self.committed_at else 0.0
            ),
        }


@dataclass
class Overlapped:
    """How an overlapped rollout starts (the weights it samples first) and what it switches to."""

    start_checkpoint: str
    start_version: int
    next_policy: NextPolicy
