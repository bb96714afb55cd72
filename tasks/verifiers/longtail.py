"""The long-tail task's verifier: the counted-down list, exactly (``models.builtin.longtail``).

A pure function of (completion, reference). A completion that stops early, skips a number or runs on
past the last one is the model's failure; a reference that is not a comma-separated count-down is
the dataset's, raised as a permanent infrastructure failure. Its latency in the long-tail preset comes
from ``tasks.verifiers.simulated_env`` (a simulation), never from here.
"""

from __future__ import annotations

import re

from tasks.verifiers.outcome import Outcome, Verdict, VerifierInfraError

VERSION = "1"  # bump when the matching rule changes; recorded with every reward

_COUNTDOWN = re.compile(r"\d+(,\d+)*")


def verify_longtail(completion_text: str, reference: str) -> Verdict:
    """Reward 1 when the completion (surrounding whitespace ignored) is the reference list, else 0."""
    if not _COUNTDOWN.fullmatch(reference):
        raise VerifierInfraError(f"reference {reference!r} is not a comma-separated list of numbers", retryable=False)
    if completion_text.strip() == reference:
        return Verdict(1.0, Outcome.SUCCESS)
    return Verdict(0.0, Outcome.MODEL_FAILURE)
