"""The built-in addition task's verifier: exact integer match of the whole completion."""

from __future__ import annotations

import re

from tasks.verifiers.outcome import Outcome, Verdict, VerifierInfraError

VERSION = "1"  # bump when the matching rule changes; recorded with every reward

_INTEGER = re.compile(r"[+-]?\d+")


def verify_addition(completion_text: str, reference: str) -> Verdict:
    """Exact integer match of the whole completion (surrounding whitespace ignored).

    The built-in policy answers with digits then end-of-sequence, so anything beyond the digits
    ("12+", "1 2", "") is the model's failure, not an unparseable sample.
    """
    try:
        expected = int(reference)
    except ValueError as exc:  # a bad reference is the dataset's fault, never the model's
        raise VerifierInfraError(f"reference {reference!r} is not an integer", retryable=False) from exc
    answer = completion_text.strip()
    if _INTEGER.fullmatch(answer) and int(answer) == expected:
        return Verdict(1.0, Outcome.SUCCESS)
    return Verdict(0.0, Outcome.MODEL_FAILURE)
