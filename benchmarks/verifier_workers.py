"""How many verifier workers a preset's rollout needs: the same rounds collected with each ``verify.workers``.

    python benchmarks/verifier_workers.py --storage DIR [--preset long-tail] [--checkpoint CKPT]
        [--workers 64,256] [--rounds 3] [--device auto] [--json PATH]

From the preset's base (built under DIR on first use) or from ``--checkpoint`` (a round's checkpoint
directory, e.g. a late round of a campaign, where most samples are short and the engine finishes them
fastest), ``--rounds`` consecutive rollouts with the preset's collection, each round's carry-over handed
to the next, for every worker count; the counts alternate round by round so a slow spell of a shared
machine falls on each alike. Printed per count: the rollout's median seconds, samples finished per
second, and the median of the rounds' ``verify/queue_wait_p99_s`` (how long the slowest finished samples
waited for a free verifier); then each count's speed-up over the first. Behind the long-tail preset's
SIMULATED environment a worker is a thread waiting out a delay, so more workers stand for a remote
environment that serves more calls at once. The base build and the engine run on ``--device``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", required=True, help="storage root (the preset's base is cached there)")
    parser.add_argument("--preset", default="long-tail")
    parser.add_argument("--checkpoint", help="a checkpoint directory to roll out from (default: the preset's base)")
    parser.add_argument("--workers", default="64,256", help="comma-separated verify.workers to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (as a round's device)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    try:
        counts = [int(w) for w in args.workers.split(",")]
    except ValueError:
        parser.error(f"--workers: expected comma-separated integers, got {args.workers!r}")
    if not counts or min(counts) < 1:
        parser.error("--workers: every count must be at least 1")
    from flows.cli import quiet_libraries

    quiet_libraries(debug=False)
    from flows.config import load_campaign_config
    from storage import checkpoints
    from storage.paths import StorageRoot
    from tasks.campaign.base_policy import run_prepare_base
    from tasks.rollout.collection import RolloutCollection
    from tasks.serving.engines import build_engine, load_tokenizer

    rc = load_campaign_config(None, args.preset).round
    source = args.checkpoint
    if source is None:
        base = run_prepare_base(
            storage=args.storage, base_model=rc.policy.base_model, progress=print, device=args.device
        )
        source = checkpoints.local_copy(StorageRoot.of(args.storage), base.checkpoint)
    elif not os.path.isdir(source):
        parser.error(f"--checkpoint: {source} is not a directory")
    engine = build_engine(
        rc.rollout.engine,
        source,
        dtype=rc.rollout.dtype,
        policy_version=0,
        max_batch=rc.rollout.max_batch,
        device=args.device,
    )
    tokenizer = load_tokenizer(source)
    seen: dict[int, list[dict]] = {w: [] for w in counts}
    carried: dict[int, list] = {w: [] for w in counts}
    for k in range(1, args.rounds + 1):
        for workers in counts:
            verify = rc.verify_resolved.model_copy(update={"workers": workers})
            start = time.perf_counter()
            result = RolloutCollection(
                engine,
                tokenizer,
                prompts=rc.prompts,
                rollout=rc.rollout,
                verify=verify,
                filtering=rc.filter,
                target_groups=rc.target_groups,
                seed=args.seed + k,
                run_id="verifier-workers",
                round_index=k,
            ).collect(carried_rows=carried[workers])
            seconds = time.perf_counter() - start
            carried[workers] = result.carry_rows
            s = result.stats
            seen[workers].append(
                {"seconds": seconds, "samples": s["rollout/samples"], "queue_wait_p99_s": s["verify/queue_wait_p99_s"]}
            )
            print(
                f"  round {k}, {workers:4d} workers: {seconds:6.2f} s, {s['rollout/samples']} samples, "
                f"queue wait p99 {s['verify/queue_wait_p99_s']:.3f} s",
                flush=True,
            )
    figures = {}
    for workers, rounds in seen.items():
        figures[str(workers)] = {
            "seconds_median": statistics.median(r["seconds"] for r in rounds),
            "samples_per_s": sum(r["samples"] for r in rounds) / sum(r["seconds"] for r in rounds),
            "queue_wait_p99_s_median": statistics.median(r["queue_wait_p99_s"] for r in rounds),
        }
    first = figures[str(counts[0])]["seconds_median"]
    print(f"\nrollout from {source}, preset {args.preset}, {args.rounds} rounds per count:")
    for workers in counts:
        f = figures[str(workers)]
        f["speedup_over_first"] = first / f["seconds_median"]
        print(
            f"  {workers:4d} workers: median {f['seconds_median']:.2f} s a round, {f['samples_per_s']:.0f} samples/s, "
            f"queue wait p99 {f['queue_wait_p99_s_median']:.3f} s; {f['speedup_over_first']:.2f}x {counts[0]} workers"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
