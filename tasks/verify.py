"""Verification: turn a finished sample into a reward and an outcome.

Verifiers are pure functions of (completion_text, reference). They say three different things:

- a reward in [0, 1] with outcome ``success`` or ``model_failure`` -- the model's own doing;
- ``VerifierInfraError`` raised -- the environment failed (sandbox could not start, verifier bug,
  the verifier itself timed out); the sample must never enter the gradient as a zero reward;
- reward ``None`` with outcome ``unknown`` -- the verifier ran but cannot score this sample.

The ``VerifierPool`` runs verifiers beside generation so finished samples are scored while others
still generate; its size is set independently of the rollout engine.
"""

from __future__ import annotations

import enum
import math
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field


class VerifyConfig(BaseModel):
    """How finished samples are scored."""

    model_config = ConfigDict(extra="forbid")

    verifier: str | None = None
    """Verifier name; default: the prompts' task name (e.g. 'addition')."""
    workers: int = Field(2, ge=1, le=256)
    """Verifier threads, sized independently of the engine: scoring overlaps generation."""
    max_infra_failure_rate: float = Field(0.2, ge=0.0, le=1.0)
    """A round whose share of infrastructure failures exceeds this fails loudly instead of training."""


class Outcome(str, enum.Enum):
    SUCCESS = "success"
    MODEL_FAILURE = "model_failure"
    INFRA_FAILURE = "infra_failure"
    UNKNOWN = "unknown"


class VerifierInfraError(RuntimeError):
    """The environment, not the model, failed while scoring a sample."""


@dataclass(frozen=True)
class Verdict:
    reward: float | None
    outcome: Outcome
    error: str | None = None
    latency_s: float = 0.0


Verifier = Callable[[str, str], Verdict]
"""(completion_text, reference) -> Verdict. Raises VerifierInfraError on infrastructure failure."""


# -- the built-in addition task ------------------------------------------------------------------

_INTEGER = re.compile(r"[+-]?\d+")


def verify_addition(completion_text: str, reference: str) -> Verdict:
    """Exact integer match of the whole completion (surrounding whitespace ignored).

    The built-in policy answers with digits then end-of-sequence, so anything beyond the digits
    ("12+", "1 2", "") is the model's failure, not an unparseable sample.
    """
    try:
        expected = int(reference)
    except ValueError as exc:  # a bad reference is the dataset's fault, never the model's
        raise VerifierInfraError(f"reference {reference!r} is not an integer") from exc
    answer = completion_text.strip()
    if _INTEGER.fullmatch(answer) and int(answer) == expected:
        return Verdict(1.0, Outcome.SUCCESS)
    return Verdict(0.0, Outcome.MODEL_FAILURE)


# -- verifiers in their own modules, imported on first use so importing this module stays cheap ----


def verify_math(completion_text: str, reference: str) -> Verdict:
    """Free-form final answers ("#### 42", "\\boxed{...}"), via math-verify: tasks/verify_math.py."""
    from tasks.verify_math import verify_math as verify

    return verify(completion_text, reference)


def verify_python(completion_text: str, reference: str) -> Verdict:
    """The completion's Python code against the reference's asserts, sandboxed: tasks/sandbox.py."""
    from tasks.sandbox import verify_python as verify

    return verify(completion_text, reference)


VERIFIERS: dict[str, Verifier] = {"addition": verify_addition, "math": verify_math, "python": verify_python}
# "math" and "python" must equal tasks.verify_math.VERSION and tasks.sandbox.VERSION (a test checks).
VERIFIER_VERSIONS: dict[str, str] = {"addition": "1", "math": "1", "python": "1"}


def get_verifier(name: str) -> Verifier:
    try:
        return VERIFIERS[name]
    except KeyError:
        known = ", ".join(sorted(VERIFIERS))
        raise ValueError(f"unknown verifier {name!r}; set verifier to one of: {known}") from None


def run_verifier(verifier: Verifier, completion_text: str, reference: str) -> Verdict:
    """Call a verifier and classify whatever happens, timing it.

    A verifier bug (any exception other than VerifierInfraError) is also an infrastructure failure:
    the model did nothing wrong. A non-finite reward is a verifier bug too.
    """
    start = time.perf_counter()
    try:
        verdict = verifier(completion_text, reference)
        if verdict.reward is not None and not math.isfinite(verdict.reward):
            raise VerifierInfraError(f"verifier returned non-finite reward {verdict.reward!r}")
    except VerifierInfraError as exc:
        verdict = Verdict(None, Outcome.INFRA_FAILURE, f"{exc}")
    except Exception as exc:  # noqa: BLE001 -- classified, never swallowed silently
        verdict = Verdict(None, Outcome.INFRA_FAILURE, f"verifier error: {type(exc).__name__}: {exc}")
    return Verdict(verdict.reward, verdict.outcome, verdict.error, time.perf_counter() - start)


class VerifierPool:
    """Verifies samples on worker threads while the engine keeps generating.

    Threads suit verifiers that are cheap or that wait on a subprocess (sandboxes); a verifier that
    burns Python CPU should start its own process.
    """

    def __init__(self, verifier: Verifier, workers: int = 2) -> None:
        if workers < 1:
            raise ValueError(f"verifier pool needs at least 1 worker, got {workers}")
        self._verifier = verifier
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verifier")

    def submit(self, completion_text: str, reference: str) -> Future[Verdict]:
        return self._executor.submit(run_verifier, self._verifier, completion_text, reference)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
