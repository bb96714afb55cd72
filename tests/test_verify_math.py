"""The math verifier: final-answer formats, outcome classification, its own deadline, threads."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.config.verify import VerifyConfig
from tasks.verifiers import math as math_module
from tasks.verifiers.math import MathVerifier
from tasks.verifiers.outcome import Outcome
from tasks.verifiers.pool import VerifierPool, run_verifier
from tasks.verifiers.registry import get_verifier, verifier_version

GSM_MINI = Path(__file__).resolve().parents[1] / "tasks" / "prompts" / "gsm_mini.jsonl"

S, F, I = Outcome.SUCCESS, Outcome.MODEL_FAILURE, Outcome.INFRA_FAILURE


@pytest.fixture(scope="module")
def math_verifier() -> Iterator[MathVerifier]:
    verifier = MathVerifier(timeout_s=5.0)
    yield verifier
    verifier.close()  # no worker process outlives the module


CASES = [
    # (completion_text, reference, expected outcome)
    ("#### 42", "42", S),  # GSM8K's answer marker
    ("Three boxes of 14 make 42.\n#### 42", "42", S),  # reasoning before the marker
    ("The answer is \\boxed{42}.", "42", S),  # LaTeX box
    ("\\boxed{42} is what I first thought, then I rechecked: 42", "42", S),  # the box wins over later numbers
    ("\\boxed{\\frac{1}{2}}", "0.5", S),  # fraction against a decimal reference
    ("#### 1/2", "\\frac{1}{2}", S),  # plain fraction against a LaTeX reference
    ("$\\frac{3}{6}$", "1/2", S),  # unreduced fraction is still equal
    ("\\boxed{\\dfrac{9}{2}}", "4.5", S),  # display-style fraction
    ("#### 1,077", "1077", S),  # thousands separator
    ("#### $18", "18", S),  # currency sign
    ("#### 2.40", "2.4", S),  # trailing zero
    ("#### 25%", "25", S),  # percent sign on the same number
    ("#### -16", "-16", S),  # negative answer
    ("\\boxed{x = 7}", "7", S),  # an assignment whose value is the reference
    ("\\boxed{1.41421356}", "\\sqrt{2}", S),  # bare LaTeX reference, numeric answer to 6 places
    ("#### 16", "-16", F),  # lost the sign
    ("\\boxed{41}", "42", F),  # off by one
    ("\\boxed{41.9999999}", "42", F),  # close is not equal beyond the rounding precision
    ("#### 4 1/2", "4.5", F),  # a mixed number reads as the last number, 1/2: the model's format fails
    ("I don't know.", "42", F),  # no number at all: nothing parseable is the model's failure
    ("", "42", F),  # empty completion
    ("\\boxed{}", "42", F),  # empty box
    ("#### forty-two", "42", F),  # words, not maths
    ("#### 42", "forty-two", I),  # a reference that does not parse is the dataset's fault
    ("#### 42", "", I),  # empty reference
    ("#### 42", "N/A", I),  # a placeholder left in the dataset
]


@pytest.mark.parametrize(("completion", "reference", "expected"), CASES)
def test_math_verifier_classifies(
    math_verifier: MathVerifier, completion: str, reference: str, expected: Outcome
) -> None:
    verdict = run_verifier(math_verifier, completion, reference)
    assert verdict.outcome is expected, verdict
    assert verdict.reward == {S: 1.0, F: 0.0, I: None}[expected]
    if expected is F:
        assert verdict.error  # a failure says why, for the health report


def test_no_answer_says_so(math_verifier: MathVerifier) -> None:
    verdict = run_verifier(math_verifier, "I don't know.", "42")
    assert verdict.error is not None and "no parseable final answer" in verdict.error


def test_own_deadline_is_an_infra_failure_and_the_verifier_recovers() -> None:
    # SymPy never finishes comparing a power tower with 1; math-verify's SIGALRM would have
    # swallowed this into "not equal". Ours kills the worker and says the verifier failed.
    verifier = MathVerifier(timeout_s=1.0)
    try:
        verdict = run_verifier(verifier, "\\boxed{9^{9^{9^{9}}}}", "1")
        assert verdict.outcome is I and verdict.reward is None
        assert verdict.error is not None and "within 1.0s" in verdict.error
        assert run_verifier(verifier, "#### 3", "3").outcome is S  # a fresh worker takes over
    finally:
        verifier.close()


def test_works_on_verifier_pool_threads(math_verifier: MathVerifier) -> None:
    # math-verify's own timeouts raise ValueError off the main thread; the pool is all threads.
    samples = [(f"#### {n}", str(n if n % 3 else n + 1)) for n in range(12)]
    with VerifierPool(math_verifier, workers=2) as pool:
        verdicts = [future.result() for future in [pool.submit(c, r) for c, r in samples]]
    assert [v.outcome for v in verdicts] == [S if n % 3 else F for n in range(12)]


def test_worker_killed_from_outside_is_replaced(math_verifier: MathVerifier) -> None:
    assert run_verifier(math_verifier, "#### 1", "1").outcome is S
    for worker in list(math_verifier._idle):
        worker._proc.kill()
        worker._proc.wait()
    assert run_verifier(math_verifier, "#### 2", "2").outcome is S


def test_registered_as_math_with_the_configured_deadline() -> None:
    assert verifier_version("math") == math_module.VERSION
    verifier = get_verifier("math", VerifyConfig(math_timeout_s=2.5))
    try:
        assert verifier.timeout_s == 2.5  # verify.math_timeout_s reaches the verifier
        # one shared pool of workers per deadline
        assert get_verifier("math", VerifyConfig(math_timeout_s=2.5)) is verifier
        assert run_verifier(verifier, "#### 3", "3").outcome is S
    finally:
        verifier.close()  # its worker would otherwise live until pytest exits


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="set a few seconds"):
        MathVerifier(timeout_s=0)


def _gsm_rows() -> list[dict[str, str]]:
    return [json.loads(line) for line in GSM_MINI.read_text().splitlines() if line.strip()]


def test_gsm_mini_is_well_formed() -> None:
    rows = _gsm_rows()
    assert len(rows) >= 30
    assert all(set(row) == {"prompt", "reference"} for row in rows)
    assert len({row["prompt"] for row in rows}) == len(rows)  # no duplicated problems


def test_every_gsm_mini_reference_verifies_against_itself(math_verifier: MathVerifier) -> None:
    for row in _gsm_rows():
        ref = row["reference"]
        for completion in (f"#### {ref}", f"\\boxed{{{ref}}}"):
            verdict = run_verifier(math_verifier, completion, ref)
            assert verdict.outcome is S, (completion, ref, verdict)


def test_a_deadline_that_repeats_for_the_same_answer_is_the_models_failure() -> None:
    # The power tower hangs SymPy every time: the first expiry could be a loaded machine (infra, so the
    # pool retries); the retry expiring too shows it is the answer, which earns reward 0.
    verifier = MathVerifier(timeout_s=1.0)
    try:
        first = run_verifier(verifier, "\\boxed{9^{9^{9^{9}}}}", "1")
        again = run_verifier(verifier, "\\boxed{9^{9^{9^{9}}}}", "1")
        assert first.outcome is I and first.reward is None
        assert again.outcome is F and again.reward == 0.0 and "two attempts" in again.error
        # another sample's first expiry is still the environment's
        assert run_verifier(verifier, "\\boxed{9^{9^{9^{8}}}}", "1").outcome is I
    finally:
        verifier.close()


def test_in_the_pool_a_repeated_deadline_is_a_model_failure_and_a_one_off_is_not() -> None:
    class SlowOnce(MathVerifier):
        """A machine so loaded that the first call of each sample misses a tiny deadline, once."""

        seen: set = set()

        def __call__(self, completion_text, reference):
            first = (completion_text, reference) not in self.seen
            self.seen.add((completion_text, reference))
            self.timeout_s = 1e-9 if first else 5.0  # expired before the reply can be read
            return super().__call__(completion_text, reference)

    hanging, one_off = MathVerifier(timeout_s=1.0), SlowOnce(timeout_s=5.0)
    try:
        with VerifierPool(hanging, workers=1, retries=2, retry_budget=10) as pool:
            verdict = pool.submit("\\boxed{9^{9^{9^{9}}}}", "1").result()
        assert verdict.outcome is F and verdict.attempts == 2  # blamed on the answer at the repeat
        with VerifierPool(one_off, workers=1, retries=2, retry_budget=10) as pool:
            verdict = pool.submit("#### 7", "7").result()
        assert verdict.outcome is S and verdict.attempts == 2  # the one-off was infra, and recovered
        with VerifierPool(SlowOnce(timeout_s=5.0), workers=1, retries=0, retry_budget=0) as pool:
            verdict = pool.submit("#### 8", "8").result()
        assert verdict.outcome is I  # a one-off deadline with no retry left stays the environment's
    finally:
        hanging.close()
        one_off.close()
