"""The table benchmarks/gpu_check.sh ends with: the gpu tests, the campaign on the GPU, the collection benchmark.

    python benchmarks/gpu_check_table.py OUT   (OUT: gpu_check.sh's --out directory)

Reads what the three steps left in OUT: tests.log (pytest's summary line), the campaign's MLflow store
under campaign-data/ (run id gpu-check) and campaign.seconds, and batch_collection.json. A step that
left nothing reads "did not run". Exits 1 when the tests failed or a step left nothing.
"""

from __future__ import annotations

import json
import os
import sys
from statistics import mean

MODES = ("sync_barrier", "ready_pool", "partial_rollouts")


def tests_row(out: str) -> tuple[str, bool]:
    path = os.path.join(out, "tests.log")
    if not os.path.exists(path):
        return "did not run", False
    lines = [line for line in open(path).read().splitlines() if line.strip()]
    summary = lines[-1].strip("= ") if lines else "no output"
    return summary, "failed" not in summary and "error" not in summary and "passed" in summary


def campaign_rows(out: str) -> list[tuple[str, str]]:
    root = os.path.join(out, "campaign-data")
    if not os.path.exists(os.path.join(root, "mlflow.db")):
        return [("campaign", "did not run")]
    from mlflow.tracking import MlflowClient  # only once there is a store to read

    client = MlflowClient(tracking_uri=f"sqlite:///{os.path.join(root, 'mlflow.db')}")
    rounds: dict[int, dict[str, float]] = {}
    for experiment in client.search_experiments():
        runs = client.search_runs(
            [experiment.experiment_id], filter_string="tags.`rlrounds.run_id` = 'gpu-check'", max_results=10_000
        )
        for run in runs:
            index = run.data.tags.get("rlrounds.round")
            if index is not None:
                rounds[int(index)] = run.data.metrics
    if not rounds:
        return [("campaign", "no round finished")]

    def series(name: str) -> list[float]:
        return [rounds[i][name] for i in sorted(rounds) if name in rounds[i]]

    def fmt(name: str, how: str, unit: str = "") -> str:
        values = series(name)
        return f"{mean(values):{how}}{unit} mean over {len(values)} rounds" if values else "not recorded"

    last = rounds[max(rounds)]
    seconds_path = os.path.join(out, "campaign.seconds")
    seconds = open(seconds_path).read().strip() + " s" if os.path.exists(seconds_path) else "?"
    accuracy = last.get("eval/accuracy")
    return [
        ("campaign rounds", f"{len(rounds)} in {seconds}"),
        ("held-out accuracy, last round", "not recorded" if accuracy is None else f"{accuracy:.1%}"),
        ("publish latency", fmt("publish/latency_s", ".3f", " s")),
        ("engine pause", fmt("publish/engine_pause_s", ".4f", " s")),
        ("weights from memory", fmt("publish/weights_from_memory", ".0%")),
    ]


def collection_rows(out: str) -> list[tuple[str, str]]:
    path = os.path.join(out, "batch_collection.json")
    if not os.path.exists(path):
        return [("collection benchmark", "did not run")]
    figures = json.load(open(path))
    rows = []
    for mode in MODES:
        f = figures.get("collection", {}).get(mode)
        if f:
            batch, steps = f["time_to_trainable_batch_s"], f["decode_steps"]
            rows.append((f"collection, {mode}", f"{batch:.2f} s to a trainable batch, {steps:.0f} decode steps"))
    ratio = figures.get("ratios", {}).get("sync_barrier_over_partial_rollouts")
    if ratio is not None:
        rows.append(("sync_barrier / partial_rollouts", f"{ratio:.2f}x"))
    return rows or [("collection benchmark", "no figures")]


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "gpu-check"
    tests, passed = tests_row(out)
    rows = [("gpu tests", tests), *campaign_rows(out), *collection_rows(out)]
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    return 0 if passed and not any(value == "did not run" for _, value in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
