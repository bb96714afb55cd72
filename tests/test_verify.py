"""The addition verifier and the verifier pool's classification of what can go wrong."""

import math

import pytest

from tasks.verifiers.addition import verify_addition
from tasks.verifiers.outcome import Outcome, Verdict, VerifierInfraError
from tasks.verifiers.pool import VerifierPool, run_verifier


@pytest.mark.parametrize(
    "completion, reference, reward, outcome",
    [
        ("42", "42", 1.0, Outcome.SUCCESS),  # exact answer
        (" 42 ", "42", 1.0, Outcome.SUCCESS),  # surrounding whitespace is not the model's content
        ("042", "42", 1.0, Outcome.SUCCESS),  # a leading zero still names the same integer
        ("41", "42", 0.0, Outcome.MODEL_FAILURE),  # wrong sum
        ("", "42", 0.0, Outcome.MODEL_FAILURE),  # said nothing: the model's failure, not unscorable
        ("4 2", "42", 0.0, Outcome.MODEL_FAILURE),  # digits split by a space are not one integer
        ("42+", "42", 0.0, Outcome.MODEL_FAILURE),  # trailing garbage makes the answer wrong
        ("198", "198", 1.0, Outcome.SUCCESS),  # the largest sum of two operands below 100
    ],
)
def test_verify_addition(completion, reference, reward, outcome):
    verdict = verify_addition(completion, reference)
    assert verdict.reward == reward
    assert verdict.outcome == outcome


def test_bad_reference_is_an_infrastructure_failure():
    with pytest.raises(VerifierInfraError):
        verify_addition("42", "forty-two")
    verdict = run_verifier(verify_addition, "42", "forty-two")
    assert verdict.outcome == Outcome.INFRA_FAILURE and verdict.reward is None


def _crashes(completion, reference):
    raise KeyError("verifier bug")


def _nan(completion, reference):
    return Verdict(math.nan, Outcome.SUCCESS)


@pytest.mark.parametrize(
    "verifier, fragment",
    [
        (_crashes, "KeyError"),  # a bug in the verifier is never the model's failure
        (_nan, "non-finite"),  # a NaN reward would poison the advantages
    ],
)
def test_verifier_faults_become_infra_failures(verifier, fragment):
    verdict = run_verifier(verifier, "1", "1")
    assert verdict.outcome == Outcome.INFRA_FAILURE
    assert verdict.reward is None
    assert fragment in verdict.error


def test_pool_verifies_concurrently_and_times():
    with VerifierPool(verify_addition, workers=3) as pool:
        futures = [pool.submit(str(i + 1), str(i + 1)) for i in range(20)]
        verdicts = [f.result() for f in futures]
    assert all(v.outcome == Outcome.SUCCESS for v in verdicts)
    assert all(v.latency_s >= 0 for v in verdicts)


def test_pool_needs_a_worker():
    with pytest.raises(ValueError, match="at least 1 worker"):
        VerifierPool(verify_addition, workers=0)
