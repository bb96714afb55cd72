"""One round's rollout on the built-in base: time to a trainable batch and samples generated, with partial
rollouts on (the default) and off, and with the verifier called on the rollout's thread (the default for
the built-in task's) or through the verifier pool's worker threads, measured in one run.

    python benchmarks/rollout_round.py --storage DIR [--groups 2048] [--repeats 2] [--device auto] [--json PATH]
    python benchmarks/rollout_round.py --storage DIR --max-batch 1024,4096 [--repeats 3]

``--max-batch``: instead, the default round's rollout (partial rollouts, the verifier inline) on an engine of each
``rollout.max_batch`` given, alternated within each repeat; the first width is the baseline of the ratios.

DIR is a storage root; the built-in base is built there on first use (a minute or two) and reused after.
The base build and the engine run on ``--device`` (auto: CUDA when visible, else the CPU).
Each repeat runs both modes back to back, so the ratio compares like with like on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def one_round(engine, tokenizer, groups: int, partial: bool, seed: int, inline: bool = True) -> dict:
    import tasks.rollout.collection
    from tasks.config.filter import FilterConfig
    from tasks.config.prompts import PromptsConfig
    from tasks.config.rollout import RolloutConfig
    from tasks.config.verify import VerifyConfig
    from tasks.rollout.collection import RolloutCollection

    declared = tasks.rollout.collection.scores_inline
    if not inline:  # what every verifier got before ``VerifierSpec.inline``: a worker thread per call
        tasks.rollout.collection.scores_inline = lambda name, config: False
    start = time.perf_counter()
    try:
        result = RolloutCollection(
            engine=engine,
            tokenizer=tokenizer,
            prompts=PromptsConfig(),
            rollout=RolloutConfig(partial_rollouts=partial),
            verify=VerifyConfig(),
            filtering=FilterConfig(),
            target_groups=groups,
            seed=seed,
            run_id="bench",
            round_index=1,
        ).collect()
    finally:
        tasks.rollout.collection.scores_inline = declared
    return {
        "seconds": time.perf_counter() - start,
        "time_to_trainable_batch_s": result.stats["rollout/time_to_trainable_batch_s"],
        "rows": len(result.rows),
        "carried_samples": len(result.carry_rows),
        "rows_hash": hash(tuple((r.group_id, tuple(r.completion_token_ids)) for r in result.rows)),
    }


def compare_widths(engines: dict, tokenizer, groups: int, repeats: int, json_path: str | None) -> None:
    """The default round's rollout at each engine width, alternated; ratios against the first width."""
    runs: dict[int, list[dict]] = {w: [] for w in engines}
    for repeat in range(repeats):
        for width, engine in engines.items():
            r = one_round(engine, tokenizer, groups, partial=True, seed=repeat)
            runs[width].append(r)
            print(
                f"repeat {repeat} max_batch {width:5d}: stage {r['seconds']:6.2f} s, time to trainable batch "
                f"{r['time_to_trainable_batch_s']:6.2f} s, {r['rows']} rows, {r['carried_samples']} carried over",
                flush=True,
            )
    base = next(iter(engines))
    summary = {
        w: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "rows", "carried_samples")}
        for w, rs in runs.items()
    }
    for width, figures in summary.items():
        ratio = summary[base]["seconds"] / figures["seconds"]
        print(
            f"max_batch {width}: median stage {figures['seconds']:.2f} s ({ratio:.2f}x the speed of {base}), "
            f"{figures['rows']:.0f} rows, {figures['carried_samples']:.0f} carried over"
        )
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"median": summary, "runs": runs}, f, indent=2)


def main() -> None:
    from tasks.config.train import TrainConfig

    train = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", required=True)
    parser.add_argument(
        "--groups",
        type=int,
        default=train.groups_per_step * train.steps_per_round,
        help="trainable groups per round (default: the default round's)",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (as a round's device)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--max-batch", help="compare engine widths instead (comma-separated rollout.max_batch)")
    args = parser.parse_args()

    from storage import checkpoints
    from storage.paths import StorageRoot
    from tasks.campaign.base_policy import run_prepare_base
    from tasks.serving.engines import build_engine, load_tokenizer

    base = run_prepare_base(storage=args.storage, base_model="builtin", device=args.device)
    local = checkpoints.local_copy(StorageRoot.of(args.storage), base.checkpoint)
    engine = build_engine("embedded", local, dtype="float32", policy_version=0, max_batch=1024, device=args.device)
    tokenizer = load_tokenizer(local)
    if args.max_batch:
        widths = [int(w) for w in args.max_batch.split(",")]
        engines = {
            w: build_engine("embedded", local, dtype="float32", policy_version=0, max_batch=w, device=args.device)
            for w in widths
        }
        compare_widths(engines, tokenizer, args.groups, args.repeats, args.json)
        return
    modes = (("partial_rollouts", True, True), ("run_to_completion", False, True), ("verifier_threads", True, False))
    runs: dict[str, list[dict]] = {mode: [] for mode, _, _ in modes}
    for repeat in range(args.repeats):
        for mode, partial, inline in modes:
            runs[mode].append(one_round(engine, tokenizer, args.groups, partial, seed=repeat, inline=inline))
            r = runs[mode][-1]
            print(
                f"repeat {repeat} {mode:18s} time to trainable batch {r['time_to_trainable_batch_s']:6.2f} s, "
                f"stage done {r['seconds']:6.2f} s, "
                f"{r['rows']} rows kept for filtering, {r['carried_samples']} samples carried over",
                flush=True,
            )
    summary = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    ratio = (
        summary["run_to_completion"]["time_to_trainable_batch_s"]
        / summary["partial_rollouts"]["time_to_trainable_batch_s"]
    )
    threads = summary["verifier_threads"]["seconds"] / summary["partial_rollouts"]["seconds"]
    same_rows = all(
        a["rows_hash"] == b["rows_hash"] for a, b in zip(runs["partial_rollouts"], runs["verifier_threads"])
    )
    print(
        f"median time to a trainable batch: partial {summary['partial_rollouts']['time_to_trainable_batch_s']:.2f} s, "
        f"run to completion {summary['run_to_completion']['time_to_trainable_batch_s']:.2f} s ({ratio:.2f}x)"
    )
    print(
        f"median stage seconds: verifier on the rollout's thread {summary['partial_rollouts']['seconds']:.2f} s, "
        f"on worker threads {summary['verifier_threads']['seconds']:.2f} s ({threads:.2f}x); "
        f"the same rows: {same_rows}"
    )
    if args.json:
        figures = {"ratio_run_to_completion_over_partial": ratio, "ratio_threads_over_inline": threads}
        with open(args.json, "w") as f:
            json.dump({"median": summary, **figures, "same_rows": same_rows, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
