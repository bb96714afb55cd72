"""What a verifier says about one sample, shared by every verifier, the pool and the stages.

Verifiers are pure functions of (completion_text, reference). They say three different things:

- a reward in [0, 1] with outcome ``success`` or ``model_failure`` -- the model's own doing;
- ``VerifierInfraError`` raised -- the environment failed (sandbox could not start, worker died,
  verifier bug, the verifier itself timed out); the sample must never enter the gradient as a zero
  reward. ``retryable=False`` marks failures a second attempt cannot fix (a bad reference);
- reward ``None`` with outcome ``unknown`` -- the verifier ran but cannot score this sample.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class Outcome(str, enum.Enum):
    SUCCESS = "success"
    MODEL_FAILURE = "model_failure"
    INFRA_FAILURE = "infra_failure"
    UNKNOWN = "unknown"


class VerifierInfraError(RuntimeError):
    """The environment, not the model, failed while scoring a sample.

    ``retryable=False``: another attempt cannot help (the reference itself is broken)."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class Verdict:
    reward: float | None
    outcome: Outcome
    error: str | None = None
    latency_s: float = 0.0
    attempts: int = 1


Verifier = Callable[[str, str], Verdict]
"""(completion_text, reference) -> Verdict. Raises VerifierInfraError on infrastructure failure."""
