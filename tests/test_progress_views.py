"""What the Prefect UI shows while a campaign runs, as pure layouts: the rounds table and the health
report (one short figure per cell, so the artifact page does not run off the side)."""

from flows.progress import artifact_key, rounds_table
from tasks.round.report import health_report

STATS = {
    "rollout/time_to_trainable_batch_s": 1.5,
    "rollout/groups": 40,
    "rollout/target_groups": 32,
    "rollout/gen_latency_p50_s": 0.1,
    "rollout/gen_latency_max_s": 0.9,
    "filter/length_q1_max_tokens": 3,
    "filter/length_q1_kept_share": 0.2,
    "filter/length_q1_generated_share": 0.25,
    "verify/success": 100,
    "verify/model_failure": 156,
    "eval/accuracy": 0.5,
    "eval/accuracy_train_precision": 0.52,
    "eval/serving_gap": -0.02,
    "eval/engine": "embedded",
    "eval/dtype": "bfloat16",
    "time/rollout_s": 2.0,
    "time/round_s": 5.0,
}


def test_health_report_cells_are_short_and_every_question_is_answered():
    report = health_report("run", 3, STATS, "p/4", "abc")
    rows = [line for line in report.splitlines() if line.startswith("| ") and "---" not in line]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    measures, values = [c[1] for c in cells if len(c) == 3], [c[2] for c in cells if len(c) == 3]
    assert max(map(len, measures)) <= 55, max(measures, key=len)  # the table fits a page's width
    assert max(map(len, values)) <= 24, max(values, key=len)
    questions = {row.strip("|").split("|")[0].strip() for row in rows} - {""}
    assert {
        "batch readiness",
        "long tail",
        "carry-over",
        "length bias",
        "policy freshness",
        "numeric alignment",
        "environment reliability",
        "weight publication",
        "evaluation",
    } <= questions
    assert "| batch readiness | time to a trainable batch | 1.50 s |" in report
    assert "| | accuracy at training precision | 52.0% |" in report.replace("|  |", "| |")
    assert "| rollout_s | 2.00 |" in report


def test_rounds_table_has_one_row_per_round_with_blank_unknowns():
    rows = rounds_table(
        [
            {"round": 0, "model_version": "p/1", "accuracy": 0.4},  # the base: no reward, groups or time
            {"round": 1, "model_version": "p/2", "accuracy": 0.5, "reward": 0.61, "kept_groups": 32, "seconds": 9.25},
        ]
    )
    assert rows == [
        {
            "round": 0,
            "model version": "p/1",
            "held-out accuracy": "40.0%",
            "mean reward": "",
            "kept groups": "",
            "seconds": "",
        },
        {
            "round": 1,
            "model version": "p/2",
            "held-out accuracy": "50.0%",
            "mean reward": "0.610",
            "kept groups": "32",
            "seconds": "9.2",
        },
    ]


def test_artifact_keys_are_what_prefect_accepts():
    assert artifact_key("campaign", "Nightly_2026.11", "rounds") == "campaign-nightly-2026-11-rounds"
    assert artifact_key("--a", "", "b--") == "a-b"
