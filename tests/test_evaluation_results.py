"""Typed evaluation results: the metric names they log, the tags they are read back from, and the stage
records written before they were typed (a campaign resumed across the change finds its rounds)."""

import pytest

from tasks.evaluate.approval import approval_markdown
from tasks.evaluate.gate import GATE_TAG, PROMOTED_TAG
from tasks.evaluate.stage import evaluation_tags, precision_tags, recorded_evaluation
from tasks.round.results import Evaluation, HeldOutScores, Promotion, Published

SCORES = HeldOutScores(
    accuracy=0.75,
    prompts=500,
    infra_failures=2,
    mean_tokens=3.5,
    engine="embedded",
    dtype="bfloat16",
    accuracy_train_precision=0.8,
    serving_gap=-0.05,
)
SCORE_METRICS = {
    "eval/accuracy": 0.75,
    "eval/prompts": 500,
    "eval/infra_failures": 2,
    "eval/mean_tokens": 3.5,
    "eval/engine": "embedded",
    "eval/dtype": "bfloat16",
    "eval/accuracy_train_precision": 0.8,
    "eval/serving_gap": -0.05,
}


def _evaluation(**verdict) -> Evaluation:
    return Evaluation(**SCORES.model_dump(), **verdict)


@pytest.mark.parametrize(
    "evaluation, verdict_metrics",
    [
        # the first version of a line: no champion to compare with, promoted
        (_evaluation(promoted=True, gate_passed=True), {"eval/promoted": 1.0, "eval/gate_passed": 1.0}),
        # below the champion: its accuracy is logged beside the candidate's
        (
            _evaluation(champion_accuracy=0.8, promoted=False, gate_passed=False),
            {"eval/champion_accuracy": 0.8, "eval/promoted": 0.0, "eval/gate_passed": 0.0},
        ),
        # passed, then approved by a person: the decision is logged too
        (
            _evaluation(champion_accuracy=0.7, promoted=False, gate_passed=True).decided(Promotion(approved=True)),
            {"eval/champion_accuracy": 0.7, "eval/promoted": 1.0, "eval/gate_passed": 1.0, "eval/approved": 1.0},
        ),
        # passed, then rejected (or no answer in time)
        (
            _evaluation(promoted=False, gate_passed=True).decided(Promotion(approved=False)),
            {"eval/promoted": 0.0, "eval/gate_passed": 1.0, "eval/approved": 0.0},
        ),
    ],
)
def test_an_evaluation_logs_its_scores_and_verdict_under_eval(evaluation, verdict_metrics):
    assert evaluation.metrics() == {**SCORE_METRICS, **verdict_metrics}
    assert SCORES.metrics() == SCORE_METRICS


def test_an_evaluation_record_round_trips():
    evaluation = _evaluation(champion_accuracy=0.7, promoted=True, gate_passed=True)
    assert Evaluation.model_validate(evaluation.model_dump(mode="json")) == evaluation


@pytest.mark.parametrize(
    "stats, expected",
    [
        # a round's own evaluation, gated against a champion
        (
            {**SCORE_METRICS, "eval/champion_accuracy": 0.7, "eval/promoted": 1.0, "eval/gate_passed": 1.0},
            _evaluation(champion_accuracy=0.7, promoted=True, gate_passed=True),
        ),
        # read back from the version's tags: every figure a float, no champion accuracy
        (
            {
                **SCORE_METRICS,
                "eval/prompts": 500.0,
                "eval/infra_failures": 2.0,
                "eval/promoted": 0.0,
                "eval/gate_passed": 0.0,
            },
            _evaluation(promoted=False, gate_passed=False),
        ),
    ],
)
def test_an_evaluate_record_written_before_the_typed_result_loads(stats, expected):
    loaded = Evaluation.model_validate({"stats": stats})
    assert loaded == expected
    assert loaded.metrics() == stats  # the round logs the same figures it logged before


@pytest.mark.parametrize(
    "record, approved",
    [
        ({"stats": {"eval/promoted": 1.0, "eval/approved": 1.0}}, True),  # an approval, recorded before typing
        ({"stats": {"eval/promoted": 0.0, "eval/approved": 0.0}}, False),  # a rejection or timeout, likewise
        ({"approved": True}, True),  # recorded since
    ],
)
def test_a_promote_record_loads(record, approved):
    promotion = Promotion.model_validate(record)
    assert promotion.approved is approved
    assert promotion.metrics() == {"eval/promoted": float(approved), "eval/approved": float(approved)}


@pytest.mark.parametrize(
    "record, accuracy",
    [
        # the base's record before the field: its accuracy among the eval/ stats
        ({"model_version": "p/1", "stats": {**SCORE_METRICS, "eval/promoted": 1.0}}, 0.75),
        # a round's publish stage: nothing evaluated
        ({"model_version": "p/2", "stats": {"publish/latency_s": 0.1}}, None),
        # recorded since: the field itself
        ({"model_version": "p/3", "stats": {}, "accuracy": 0.5}, 0.5),
    ],
)
def test_a_published_record_carries_its_accuracy(record, accuracy):
    assert Published.model_validate(record).accuracy == accuracy


def _tags(**extra: str) -> dict[str, str]:
    """A gated version's eval.* tags as MLflow hands them back: every value a string."""
    written = {**evaluation_tags(SCORES), **precision_tags(SCORES), "eval.infra_failures": 2, "eval.mean_tokens": 3.5}
    return {k: str(v) for k, v in {**written, **extra}.items()}


@pytest.mark.parametrize(
    "tags, promoted, passed",
    [
        (_tags(**{PROMOTED_TAG: "1.0", GATE_TAG: "1.0"}), True, True),  # promoted by the gate
        (_tags(**{PROMOTED_TAG: "0.0", GATE_TAG: "1.0"}), False, True),  # passed, waiting for (or refused) approval
        (_tags(**{PROMOTED_TAG: "0.0", GATE_TAG: "0.0"}), False, False),  # below the champion
        (_tags(**{PROMOTED_TAG: "1.0"}), True, True),  # gated before the gate's own tag: passed as it was promoted
    ],
)
def test_a_resumed_round_reads_its_evaluation_back_from_the_tags(tags, promoted, passed):
    assert recorded_evaluation(tags) == _evaluation(promoted=promoted, gate_passed=passed)


@pytest.mark.parametrize(
    "champion, evaluation, shown",
    [
        # a champion at the same engine and dtype
        (
            "p@champion",
            _evaluation(champion_accuracy=0.7, promoted=False, gate_passed=True),
            "| 70.0% (embedded, bfloat16)",
        ),
        # none yet: nothing to show beside the candidate
        (None, _evaluation(promoted=False, gate_passed=True), "| champion (none yet) | n/a (embedded, bfloat16)"),
    ],
)
def test_the_approver_reads_the_candidate_beside_the_champion(champion, evaluation, shown):
    text = approval_markdown("p/2", champion, evaluation, 60)
    assert "| candidate p/2 | 75.0% (embedded, bfloat16) | 80.0% |" in text
    assert shown in text and "Held-out prompts: 500." in text
