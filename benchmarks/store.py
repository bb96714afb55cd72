"""Trajectory store: Parquet (the store's format) vs JSONL, on one round's worth of rows.

The rows are synthetic but shaped like a default round of the built-in task (``--groups`` groups of
``--samples`` samples: short arithmetic prompts, 1-8 completion tokens with per-token behaviour logprobs
and policy versions, binary rewards, filter decisions, timestamps), built with the store's real schema
(storage.trajectories.rows_to_table). Both formats are written by rlrounds itself: Parquet by the store
(write_version: zstd parts, sha256, manifest), JSONL by `rlrounds trajectories export --format jsonl`.

Figures, measured in this run (median of ``--repeats``):
- size on disk;
- reading the trainer's columns (tasks/train.TRAIN_COLUMNS) into memory:
    Parquet: read_table(columns=...), which also verifies every part's sha256;
    JSONL, Python: json.loads per line, keeping the trainer's columns (what a JSONL trainer would do);
    JSONL, Arrow: pyarrow.json.read_json (multi-threaded C++; parses every column, then selects);
- the same through to the trainer's Python rows (kept rows only, tasks/train.kept_rows).

With ``--lookup RUNS``: resolving a whole trajectory version id to its manifest in a root holding RUNS
campaigns of ``--rounds`` committed rounds each, by listing every run's rounds (``find_version(root, id)``)
against reading where its round keeps it (``find_version(root, id, near=(run, round))``, what a model
version's description does on every evaluation).

    python benchmarks/store.py [--groups 2500] [--samples 8] [--repeats 5]
    python benchmarks/store.py --lookup 50 [--rounds 45]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta


def round_rows(groups: int, samples: int, seed: int = 0) -> list[dict]:
    """Rows like one round of the built-in addition task (vocabulary of 16 character tokens)."""
    rng = random.Random(seed)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    rows = []
    for g in range(groups):
        a, b = rng.randrange(100), rng.randrange(100)
        prompt = f"{a}+{b}="
        prompt_ids = [1] + [rng.randrange(3, 16) for _ in prompt]
        rewards = [float(rng.random() < 0.4) for _ in range(samples)]
        mixed = len(set(rewards)) > 1
        mean = sum(rewards) / samples
        for i, reward in enumerate(rewards):
            n = rng.randint(1, 8)
            enqueued = start + timedelta(milliseconds=g * 7)
            rows.append(
                {
                    "run_id": "20260101-000000-abcdef",
                    "round": 3,
                    "prompt_id": f"add-{a}-{b}",
                    "group_id": f"r3-g{g:06d}",
                    "sample_index": i,
                    "task": "addition",
                    "prompt_text": prompt,
                    "prompt_token_ids": prompt_ids,
                    "reference": str(a + b),
                    "completion_text": str(rng.randrange(200))[:n],
                    "completion_token_ids": [rng.randrange(3, 16) for _ in range(n - 1)] + [2],
                    "rollout_logprobs": [-rng.expovariate(2.0) for _ in range(n)],
                    "token_policy_versions": [2] * n,
                    "finish_reason": "stop" if n < 8 else "length",
                    "engine": {"name": "embedded", "version": "torch-2.13.0", "dtype": "float32"},
                    "sampling": {"temperature": 1.0, "top_p": 1.0, "seed": 1234 + g, "max_tokens": 8},
                    "verifier": {"name": "addition", "version": "1"},
                    "reward": reward,
                    "outcome": "success" if reward else "model_failure",
                    "verify_error": None,
                    "advantage": (reward - mean) / 0.49 if mixed else 0.0,
                    "kept": mixed,
                    "drop_reason": None if mixed else "zero_variance_group",
                    "enqueued_at": enqueued,
                    "started_at": enqueued + timedelta(milliseconds=3),
                    "finished_at": enqueued + timedelta(milliseconds=40 + 5 * n),
                    "verified_at": enqueued + timedelta(milliseconds=41 + 5 * n),
                    "gen_latency_s": 0.037 + 0.005 * n,
                    "verify_latency_s": 0.0004,
                }
            )
    return rows


def median_seconds(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2500)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lookup", type=int, metavar="RUNS", help="time a version lookup in a root of RUNS runs")
    parser.add_argument("--rounds", type=int, default=45, help="with --lookup: committed rounds per run")
    args = parser.parse_args()
    if args.lookup:
        lookup(args.lookup, args.rounds, args.repeats)
        return

    import pyarrow.json as pj

    from storage.paths import StorageRoot
    from storage.query import export_table
    from storage.trajectories import read_manifest, read_table, rows_to_table, write_version
    from tasks.train.stage import TRAIN_COLUMNS, kept_rows

    table = rows_to_table(round_rows(args.groups, args.samples))
    with tempfile.TemporaryDirectory(prefix="rlrounds-bench-") as tmp:
        root = StorageRoot.of(os.path.join(tmp, "store"))
        meta = {"kind": "rollout", "run_id": "bench", "round": 3, "parent": None, "derivation": {}}
        manifest = write_version(root, lambda v: root.trajectory_version("bench", 3, v), table, meta)
        jsonl = os.path.join(tmp, "round.jsonl")
        export_table(table, "jsonl", jsonl)
        parquet_bytes = sum(p["bytes"] for p in manifest.parts)
        jsonl_bytes = os.path.getsize(jsonl)

        def parquet_read():
            return read_table(root, read_manifest(root, manifest.directory), columns=TRAIN_COLUMNS)

        def jsonl_python():
            with open(jsonl) as f:
                return [{k: row[k] for k in TRAIN_COLUMNS} for row in map(json.loads, f)]

        def jsonl_arrow():
            return pj.read_json(jsonl).select(TRAIN_COLUMNS)

        t_parquet, arrow = median_seconds(parquet_read, args.repeats)
        t_python, rows = median_seconds(jsonl_python, args.repeats)
        t_arrow, _ = median_seconds(jsonl_arrow, args.repeats)
        t_parquet_rows, kept_parquet = median_seconds(lambda: kept_rows(parquet_read()), args.repeats)
        t_python_rows, kept_jsonl = median_seconds(lambda: [r for r in jsonl_python() if r["kept"]], args.repeats)
        assert arrow.num_rows == len(rows) == table.num_rows and len(kept_parquet) == len(kept_jsonl)

    mib = 1024 * 1024
    print(
        f"one round: {table.num_rows} rows ({args.groups} groups x {args.samples} samples), {len(kept_parquet)} kept; "
        f"trainer columns: {', '.join(TRAIN_COLUMNS)}; median of {args.repeats}"
    )
    print(
        f"size        parquet {parquet_bytes / mib:7.2f} MiB   jsonl {jsonl_bytes / mib:7.2f} MiB   "
        f"jsonl/parquet {jsonl_bytes / parquet_bytes:5.1f}x  (goal >= 3x)"
    )
    print(
        f"read cols   parquet {t_parquet * 1000:7.1f} ms    jsonl(python) {t_python * 1000:7.1f} ms  -> "
        f"{t_python / t_parquet:5.1f}x   "
        f"jsonl(arrow) {t_arrow * 1000:7.1f} ms  -> {t_arrow / t_parquet:5.1f}x  (goal >= 10x)"
    )
    print(
        f"to rows     parquet {t_parquet_rows * 1000:7.1f} ms    jsonl(python) {t_python_rows * 1000:7.1f} ms  -> "
        f"{t_python_rows / t_parquet_rows:5.1f}x  (kept rows as Python dicts, what train_policy consumes)"
    )


def lookup(runs: int, rounds: int, repeats: int) -> None:
    """Time resolving the last run's last round's version, by listing and at its place (see the module doc)."""
    from storage.paths import StorageRoot
    from storage.trajectories import find_version, rows_to_table, write_version

    table = rows_to_table(round_rows(2, 2))
    with tempfile.TemporaryDirectory(prefix="rlrounds-bench-") as tmp:
        root = StorageRoot.of(os.path.join(tmp, "store"))
        for run in range(runs):
            for index in range(1, rounds + 1):
                meta = {"kind": "rollout", "run_id": f"run-{run}", "round": index, "parent": None, "derivation": {}}
                manifest = write_version(
                    root, lambda v, run=run, index=index: root.trajectory_version(f"run-{run}", index, v), table, meta
                )
            print(f"\r{run + 1}/{runs} runs written", end="", flush=True)
        print()
        near = (f"run-{runs - 1}", rounds)
        t_listed, by_listing = median_seconds(lambda: find_version(root, manifest.version), repeats)
        t_placed, by_place = median_seconds(lambda: find_version(root, manifest.version, near), repeats)
        assert by_listing.directory == by_place.directory == manifest.directory
    print(
        f"lookup of a whole version id among {runs} runs x {rounds} rounds (median of {repeats}): by listing "
        f"{t_listed * 1000:.1f} ms, at its round {t_placed * 1000:.2f} ms -> {t_listed / t_placed:.0f}x"
    )


if __name__ == "__main__":
    main()
