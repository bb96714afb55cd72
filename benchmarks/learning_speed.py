"""Learning speed: the default campaign, timed to a held-out accuracy.

    python benchmarks/learning_speed.py [--storage DIR] [--target 0.9] [--rounds N] [--stop-at-target]
                                        [--baseline-config FILE] [--seeds 0,1,2] [--device auto] [--json PATH]

Runs the campaign `rlrounds run` runs (the embedded default, or ``--config``/``--preset`` laid over it)
through its Prefect flow, judged on the full held-out set with greedy decoding at serving precision,
as the campaign reports it, on ``--device`` (round.device; default: the config's, auto). Prints:

- seconds to target: the summed ``time/round_s`` of the rounds up to the first held-out accuracy
  >= --target, and the same with the time outside rounds (start-up: Prefect, MLflow, base build or
  load, round 0's evaluation) added;
- updates to target (optimizer steps), final accuracy after the campaign's rounds;
- generated vs kept groups (over the campaign, up to the target, and per round), and the mean seconds per
  round of every stage (MLflow ``time/*``) with the train stage's own split: the update (scoring and
  optimizer steps, ``train/update_s``) against loading, saving and committing the checkpoint.

Measure on an otherwise idle machine, at normal priority: under a real-time policy (``chrt -f``) the
rollout's thread keeps both cores and the verifier threads starve, so verdicts lag generation and the
figures describe the starvation, not the pool.

``--baseline-config FILE`` runs a second campaign, laid over the same defaults with FILE, in the same
process right after, and prints the ratios: the way to compare a change of defaults on a noisy machine.
The base is built once under --storage and reused by both.

``--seeds 0,1,2`` runs every campaign once per seed (``round.seed``: prompt order and sampling), the baseline right
after the campaign of the same seed, and prints the pairs side by side and the median of their ratios after every seed
(``--json`` is rewritten then too, so a comparison stopped early keeps the seeds it finished). The seed alone
moves the default campaign's rounds to 90% by up to four (docs/performance.md), so a ratio from one seed says little
about a change that alters what is sampled or trained; a change of speed alone leaves the rounds as they were and
needs one seed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable


def paired(campaigns: list[dict], baselines: list[dict]) -> dict:
    """Seed by seed, baseline seconds to target over the campaign's (None where either missed the target), and
    the median of the ratios that exist, with the rounds and updates to target of both sides."""
    ratios = [
        None
        if not (c["seconds_to_target"] and b["seconds_to_target"])
        else b["seconds_to_target"] / c["seconds_to_target"]
        for c, b in zip(campaigns, baselines, strict=True)
    ]
    present = [r for r in ratios if r is not None]
    return {
        "ratios": ratios,
        "median_ratio": statistics.median(present) if present else None,
        "campaign_rounds": [c["rounds_to_target"] for c in campaigns],
        "baseline_rounds": [b["rounds_to_target"] for b in baselines],
        "campaign_updates": [c["updates_to_target"] for c in campaigns],
        "baseline_updates": [b["updates_to_target"] for b in baselines],
    }


def show_pairs(seeds: list[int], pairs: dict) -> None:
    def of(values: list) -> str:
        return " ".join("-" if v is None else str(v) for v in values)

    print(f"seeds {of(seeds)}: rounds to target, campaign {of(pairs['campaign_rounds'])}, "
          f"baseline {of(pairs['baseline_rounds'])}; updates, campaign {of(pairs['campaign_updates'])}, "
          f"baseline {of(pairs['baseline_updates'])}")  # fmt: skip
    ratios = " ".join("-" if r is None else f"{r:.2f}x" for r in pairs["ratios"])
    median = pairs["median_ratio"]
    median = "none: no seed reached the target on both sides" if median is None else f"{median:.2f}x"
    print(f"seconds to target, baseline / campaign, seed by seed: {ratios}; median {median}")


def round_metrics(storage: str, experiment: str, run_id: str) -> list[dict[str, float]]:
    """Every round's final metric values, from the campaign's MLflow round runs (round 1 first)."""
    from storage.paths import StorageRoot
    from storage.settings import settings
    from storage.tracking import KIND_TAG, ROUND_TAG, RUN_ID_TAG, Tracker

    tracker = Tracker.connect(settings(), StorageRoot.of(storage), must_exist=True)
    experiment_id = tracker.experiment_id(experiment)
    runs = tracker.client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}' and tags.`{KIND_TAG}` = 'round'",
        max_results=10_000,
    )
    rounds = sorted((int(r.data.tags[ROUND_TAG]), r.data.metrics) for r in runs)
    return [metrics for index, metrics in rounds if index >= 1]


def run_campaign(config, storage: str, target: float, label: str) -> dict:
    from flows.campaign import new_run_id, rl_campaign

    config = config.model_copy(update={"run_id": f"speed-{label.replace(' ', '-')}-{new_run_id()}"})
    start = time.perf_counter()
    result = rl_campaign(config=config, storage=storage, resume=False)
    wall = time.perf_counter() - start
    history = result["rounds"]
    metrics = round_metrics(storage, config.experiment, result["run_id"])
    round_seconds = [entry["seconds"] for entry in history[1:]]
    outside = wall - sum(round_seconds)
    reached = next((i for i, entry in enumerate(history[1:]) if entry["accuracy"] >= target), None)
    steps = [m.get("train/steps", 0.0) for m in metrics]  # the optimizer steps each round made
    stage_keys = sorted({k for m in metrics for k in m if k.startswith("time/")})
    figures = {
        "label": label,
        "run_id": result["run_id"],
        "target_accuracy": target,
        "seconds_to_target": None if reached is None else sum(round_seconds[: reached + 1]),
        "seconds_to_target_with_startup": None if reached is None else sum(round_seconds[: reached + 1]) + outside,
        "rounds_to_target": None if reached is None else reached + 1,
        "updates_to_target": None if reached is None else int(sum(steps[: reached + 1])),
        "base_accuracy": history[0]["accuracy"],
        "final_accuracy": history[-1]["accuracy"],
        "best_accuracy": max(entry["accuracy"] for entry in history[1:]),
        "rounds": len(history) - 1,
        "wall_s": wall,
        "outside_rounds_s": outside,
        "generated_groups": sum(m.get("rollout/groups", 0.0) for m in metrics),
        "kept_groups": sum(m.get("filter/kept_groups", 0.0) for m in metrics),
        "generated_groups_to_target": None
        if reached is None
        else sum(m.get("rollout/groups", 0.0) for m in metrics[: reached + 1]),
        "kept_groups_to_target": None
        if reached is None
        else sum(m.get("filter/kept_groups", 0.0) for m in metrics[: reached + 1]),
        "generated_per_kept_by_round": [
            m.get("rollout/groups", 0.0) / max(m.get("filter/kept_groups", 0.0), 1.0) for m in metrics
        ],
        "train_update_s": statistics.fmean(m.get("train/update_s", 0.0) for m in metrics) if metrics else 0.0,
        "stage_seconds": {
            k.removeprefix("time/"): statistics.fmean(m.get(k, 0.0) for m in metrics) for k in stage_keys
        },
        "accuracy_by_round": [entry["accuracy"] for entry in history],
    }
    return figures


def show(f: dict) -> None:
    reached = (
        f"not reached in {f['rounds']} rounds"
        if f["seconds_to_target"] is None
        else (
            f"{f['seconds_to_target']:.0f} s of rounds ({f['seconds_to_target_with_startup']:.0f} s with start-up), "
            f"round {f['rounds_to_target']}, {f['updates_to_target']} updates"
        )
    )
    print(f"[{f['label']}] base {f['base_accuracy']:.1%} -> final {f['final_accuracy']:.1%} after {f['rounds']} rounds")
    print(f"[{f['label']}] first held-out >= {f['target_accuracy']:.0%}: {reached}")
    print(
        f"[{f['label']}] outside rounds (start-up, round 0) {f['outside_rounds_s']:.0f} s; "
        f"groups generated {f['generated_groups']:.0f}, kept {f['kept_groups']:.0f} "
        f"({f['kept_groups'] / max(f['generated_groups'], 1):.0%})"
    )
    stages = f["stage_seconds"]
    total = stages.get("round_s", 0.0) or 1.0
    split = ", ".join(
        f"{name.removesuffix('_s')} {sec:.2f} s ({sec / total:.0%})"
        for name, sec in stages.items()
        if name != "round_s"
    )
    print(f"[{f['label']}] mean round {stages.get('round_s', 0.0):.2f} s: {split}")
    if f["generated_groups_to_target"] is not None:
        print(
            f"[{f['label']}] up to the target: groups generated {f['generated_groups_to_target']:.0f}, "
            f"kept {f['kept_groups_to_target']:.0f}"
        )
    print(f"[{f['label']}] held-out accuracy by round: " + " ".join(f"{a:.1%}" for a in f["accuracy_by_round"]))
    print(
        f"[{f['label']}] generated per kept, by round: "
        + " ".join(f"{x:.2f}" for x in f["generated_per_kept_by_round"])
    )
    train = stages.get("train_s", 0.0)
    if train:
        update = f["train_update_s"]
        print(
            f"[{f['label']}] train stage {train:.2f} s: update {update:.2f} s ({update / train:.0%}), "
            f"load/save/commit {train - update:.2f} s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", default="./rlrounds-bench", help="storage root (the base is cached there)")
    parser.add_argument("--config", help="a config file laid over the defaults (as `rlrounds run --config`)")
    parser.add_argument("--preset", help="a preset (as `rlrounds run --preset`)")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--rounds", type=int, help="rounds (default: the campaign's)")
    parser.add_argument("--stop-at-target", action="store_true", help="end each campaign at the target")
    parser.add_argument("--baseline-config", help="also run the campaign with this file laid over the defaults")
    parser.add_argument(
        "--seeds",
        help="comma-separated round.seed values: every campaign once per seed, the pairs compared "
        "(default: one campaign at the config's seed)",
    )
    parser.add_argument("--device", help="round.device: auto, cpu, cuda or cuda:N (default: the config's, auto)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    from flows.cli import quiet_libraries
    from flows.orphans import take_over

    quiet_libraries(debug=False)
    take_over(os.path.basename(__file__))  # a killed run's Prefect server would take CPU from the figures
    os.environ["RLROUNDS_STORAGE"] = args.storage  # the campaigns' MLflow store lives there too

    from flows.config import load_campaign_config

    def config_of(path: str | None):
        config = load_campaign_config(path, args.preset, rounds=args.rounds)
        if args.device:  # checked where the campaign starts (its preflight), as `rlrounds run` checks it
            config = config.model_copy(update={"round": config.round.model_copy(update={"device": args.device})})
        return config.model_copy(update={"stop_at_accuracy": args.target if args.stop_at_target else None})

    def save(out: dict) -> None:
        if args.json:
            write_json(args.json, out)

    if args.seeds:
        by_seed(args, config_of, save)  # saves after every seed
    else:
        save(one_pair(args, config_of))


def write_json(path: str, out: dict) -> None:
    """``out`` at ``path``, replaced whole (a stop midway leaves the previous figures, never half a file)."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(out, f, indent=2)
    os.replace(f"{path}.tmp", path)


def seeds_of(text: str) -> list[int]:
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise SystemExit(f"--seeds takes comma-separated integers such as 0,1,2, not {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds names a seed twice: {text!r}")
    return seeds


def by_seed(args, config_of, save: Callable[[dict], None] | None = None) -> dict:
    """Every campaign once per seed, each baseline right after the campaign of its seed. After every seed the pairs
    so far are printed and the figures so far handed to ``save``: a dozen seeds take the best part of an hour, and a
    comparison stopped early keeps the seeds it finished."""
    seeds = seeds_of(args.seeds)
    sides = [("campaign", args.config)] + ([("baseline", args.baseline_config)] if args.baseline_config else [])
    runs: dict[str, list[dict]] = {label: [] for label, _ in sides}
    out: dict = {}
    for done, seed in enumerate(seeds, start=1):
        for label, path in sides:
            config = config_of(path)
            config = config.model_copy(update={"round": config.round.model_copy(update={"seed": seed})})
            runs[label].append(run_campaign(config, args.storage, args.target, f"{label} seed {seed}"))
            show(runs[label][-1])
        out = {"seeds": seeds[:done], "seeds_planned": seeds, **runs}
        if args.baseline_config:
            out["pairs"] = paired(runs["campaign"], runs["baseline"])
            show_pairs(seeds[:done], out["pairs"])
        if save is not None:
            save(out)
    return out


def one_pair(args, config_of) -> dict:
    figures = run_campaign(config_of(args.config), args.storage, args.target, "campaign")
    show(figures)
    out: dict = dict(figures)
    if args.baseline_config:
        baseline = run_campaign(config_of(args.baseline_config), args.storage, args.target, "baseline")
        show(baseline)
        out["baseline"] = baseline
        if figures["seconds_to_target"] and baseline["seconds_to_target"]:
            out["baseline_over_campaign"] = baseline["seconds_to_target"] / figures["seconds_to_target"]
            print(f"seconds to target, baseline / campaign: {out['baseline_over_campaign']:.2f}x")
    return out


if __name__ == "__main__":
    main()
