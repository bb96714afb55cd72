"""Do two campaigns agree? Rows, checkpoint tensors and round metrics of one run id under two storage roots.

The check a refactor owes: run the same campaign (same config, seed and run id) before and after the
change, each under its own root, then

    python benchmarks/compare_campaigns.py ROOT_BEFORE ROOT_AFTER --run-id ID [--json OUT]

It prints one line per round and exits 1 on any difference. Compared:
- trajectory rows: every committed part of each round's version (rows and carry-over) as one table, sorted
  by (group_id, sample_index, carry_state), every column but the timing ones (``TIMING_COLUMNS``) and the
  content address (``trajectory_version``, which moves with any change to a part's bytes or schema);
  a column present in only one root is reported, and counts as a difference only when it holds a value;
- checkpoints: every tensor of ``model.safetensors`` bitwise, and ``optimizer.pt``'s tensors bitwise;
- metrics: each round run's MLflow metrics but those that time something (``timed``).

It reads the files and the MLflow store directly (pyarrow, safetensors, torch, mlflow), never the
project's own modules, so the two roots may come from different versions of the code.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

TIMING_COLUMNS = {
    "enqueued_at",
    "started_at",
    "finished_at",
    "verified_at",
    "gen_latency_s",
    "verify_latency_s",
    "trajectory_version",
}
ROW_KEY = ("group_id", "sample_index", "carry_state")


def timed(metric: str) -> bool:
    """A metric that measures time (it differs run to run by construction)."""
    return metric.startswith("time/") or metric.endswith(("_s", "_at", "per_s")) or "latency" in metric


def round_dirs(root: str, run_id: str) -> dict[int, str]:
    found = {}
    for path in glob.glob(os.path.join(root, "runs", run_id, "rounds", "*")):
        name = os.path.basename(path)
        if name.isdigit() and glob.glob(os.path.join(path, "trajectories", "*", "manifest.json")):
            found[int(name)] = path
    return found


def version_table(round_dir: str) -> pa.Table:
    """Every part of the round's committed version as one table (parts may differ in columns)."""
    (manifest,) = glob.glob(os.path.join(round_dir, "trajectories", "*", "manifest.json"))
    parts = sorted(glob.glob(os.path.join(os.path.dirname(manifest), "*.parquet")))
    # one thread: after a threaded read pyarrow 25 and 26 abort the process at exit (storage.trajectories)
    tables = [pq.read_table(p, use_threads=False) for p in parts]
    table = pa.concat_tables(tables, promote_options="default")
    keys = [(k, "ascending") for k in ROW_KEY if k in table.column_names]
    return table.sort_by(keys)


def compare_rows(a: pa.Table, b: pa.Table) -> list[str]:
    problems = []
    if a.num_rows != b.num_rows:
        return [f"rows: {a.num_rows} vs {b.num_rows}"]
    for name in sorted(set(a.column_names) | set(b.column_names)):
        if name in TIMING_COLUMNS:
            continue
        if name not in a.column_names or name not in b.column_names:
            only = a if name in a.column_names else b
            if only.column(name).null_count < only.num_rows:
                problems.append(f"column {name}: only in one root, with values")
            continue
        if a.column(name).to_pylist() != b.column(name).to_pylist():
            problems.append(f"column {name}: values differ")
    return problems


def compare_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> list[str]:
    if a.keys() != b.keys():
        return [f"{what}: tensor names differ"]
    return [f"{what}: {k} differs" for k in a if not torch.equal(a[k], b[k])]


def optimizer_tensors(path: str) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=False)
    flat: dict[str, torch.Tensor] = {}

    def walk(value, prefix: str) -> None:
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{prefix}/{k}")
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                walk(v, f"{prefix}/{i}")

    walk(state, "")
    return flat


def round_metrics(root: str, run_id: str) -> dict[int, dict[str, float]]:
    client = MlflowClient(tracking_uri=f"sqlite:///{os.path.join(root, 'mlflow.db')}")
    out: dict[int, dict[str, float]] = {}
    for experiment in client.search_experiments():
        runs = client.search_runs(
            [experiment.experiment_id], filter_string=f"tags.`rlrounds.run_id` = '{run_id}'", max_results=1000
        )
        for run in runs:
            index = run.data.tags.get("rlrounds.round")
            if index is not None and index.isdigit():
                out[int(index)] = {k: v for k, v in run.data.metrics.items() if not timed(k)}
    return out


def compare_metrics(a: dict[str, float], b: dict[str, float]) -> list[str]:
    problems = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if va is None or vb is None:
            problems.append(f"metric {key}: only in one root")
        elif not (va == vb or (math.isnan(va) and math.isnan(vb))):
            problems.append(f"metric {key}: {va!r} vs {vb!r}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--json", help="write the per-round findings here")
    args = parser.parse_args()
    rounds_a, rounds_b = round_dirs(args.before, args.run_id), round_dirs(args.after, args.run_id)
    if not rounds_a or rounds_a.keys() != rounds_b.keys():
        print(f"rounds differ: {sorted(rounds_a)} vs {sorted(rounds_b)}")
        return 1
    metrics_a, metrics_b = round_metrics(args.before, args.run_id), round_metrics(args.after, args.run_id)
    findings: dict[int, list[str]] = {}
    for n in sorted(rounds_a):
        da, db = rounds_a[n], rounds_b[n]
        ta, tb = version_table(da), version_table(db)
        problems = compare_rows(ta, tb)
        ckpt_a, ckpt_b = os.path.join(da, "checkpoint"), os.path.join(db, "checkpoint")
        problems += compare_tensors(
            load_file(os.path.join(ckpt_a, "model.safetensors")),
            load_file(os.path.join(ckpt_b, "model.safetensors")),
            "weights",
        )
        problems += compare_tensors(
            optimizer_tensors(os.path.join(ckpt_a, "optimizer.pt")),
            optimizer_tensors(os.path.join(ckpt_b, "optimizer.pt")),
            "optimizer",
        )
        problems += compare_metrics(metrics_a.get(n, {}), metrics_b.get(n, {}))
        findings[n] = problems
        verdict = "same" if not problems else f"{len(problems)} differences: " + "; ".join(problems[:8])
        print(f"round {n}: {ta.num_rows} rows, {len(metrics_a.get(n, {}))} untimed metrics: {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in findings.items()}, f, indent=2)
    return 1 if any(findings.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
