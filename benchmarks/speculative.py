"""Speculative rollout against plain sampling, from trained checkpoints, same prompts and seeds.

    python benchmarks/speculative.py [--storage DIR] [--presets long-tail,default] [--rounds 12]
                                     [--campaign-rounds N] [--config FILE] [--quick] [--json OUT]

Per preset (the long-tail one and the default one):

1. A campaign of ``--rounds`` rounds from the preset's base, speculation off (``rollout.speculative``), or the one
   already in ``--storage`` under the same run id (a rerun reuses it). Its last round's checkpoint is what the
   rest samples from, and its committed rounds are the history drafts come from.
2. Collection: the next round's rollout stage (``tasks.rollout.collection.RolloutCollection``: ready pool, verifiers,
   partial rollouts, the last round's carry-over resumed), with and without speculation, ``--repeats`` times each
   in alternation: decode steps, time to a trainable batch, acceptance, tokens per verification step, drafting and
   indexing seconds, and whether the two produced the same rows (they should: every emitted token is plain
   sampling's own draw, models/engines/speculative.py).
3. Throughput: one fixed set of the preset's prompts generated at ``max_batch`` 1, 8, 64 and the round's, with and
   without speculation: tokens per second and decode steps.
4. Learning (long-tail, ``--campaign-rounds``): the same campaign again with speculation on, from the same base and
   seed; held-out accuracy per round against the off campaign's, and the round each first reaches ``--target``.

Goals on the long-tail preset on a 2-core CPU: at least 2x fewer decode steps and at least 1.3x less time to a
trainable batch; the campaign with speculation reaches the target no later. The figures printed compare the two
in the same run; measure on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

PRESETS = ("long-tail", "default")
BATCH_SIZES = (1, 8, 64)


def campaign(storage: str, config, run_id: str, rounds: int, speculative: bool) -> dict:
    """Run (or resume, when already there) ``run_id``: its rounds' history."""
    from flows.campaign import rl_campaign
    from storage.campaigns import read_campaign
    from storage.paths import StorageRoot

    rollout = config.round.rollout.model_copy(
        update={"speculative": config.round.rollout.speculative.model_copy(update={"enabled": speculative})}
    )
    config = config.model_copy(
        update={
            "rounds": rounds,
            "stop_at_accuracy": None,
            "run_id": run_id,
            "round": config.round.model_copy(update={"rollout": rollout}),
        }
    )
    exists = read_campaign(StorageRoot.of(storage), run_id) is not None
    return {**rl_campaign(config=config, storage=storage, resume=exists), "reused": exists}


def collection(storage: str, config, run: dict, speculative: bool, live) -> dict:
    """The next round's rollout from the campaign's last checkpoint, with or without speculation."""
    from models.checkpoint import context_length
    from storage import checkpoints
    from storage.paths import StorageRoot
    from storage.trajectories import committed_round_version, read_carryover
    from tasks.rollout.collection import RolloutCollection
    from tasks.rollout.speculation import RoundSpeculation

    root = StorageRoot.of(storage)
    last = run["rounds"][-1]
    rc = config.round
    local = checkpoints.local_copy(root, last["checkpoint"])
    engine, tokenizer, _ = live.serve(
        "embedded", local, dtype=rc.rollout.dtype, policy_version=last["round"], max_batch=rc.rollout.max_batch
    )
    engine.configure(rc.rollout.max_batch, rc.rollout.update_kv)
    settings = rc.rollout.speculative.model_copy(update={"enabled": speculative})
    round_index = last["round"] + 1
    carried = read_carryover(root, committed_round_version(root, run["run_id"], last["round"]))
    speculation = RoundSpeculation(engine, settings, root, run["run_id"], round_index)
    if speculation.why_not:
        raise SystemExit(f"speculation is off: {speculation.why_not}")
    start = time.time()
    result = RolloutCollection(
        engine,
        tokenizer,
        prompts=rc.prompts,
        rollout=rc.rollout,
        verify=rc.verify_resolved,
        filtering=rc.filter,
        target_groups=rc.target_groups,
        seed=rc.seed * 1_000 + round_index,
        run_id=run["run_id"],
        round_index=round_index,
        max_context=context_length(local),
        policy_version=last["round"],
    ).collect(carried_rows=carried)
    figures = speculation.finish()
    s = result.stats
    history_s = figures.get("rollout/spec_history_s", 0.0)
    return {  # the stage reads and indexes the history before it generates: that counts
        "time_to_trainable_batch_s": s["rollout/time_to_trainable_batch_s"] + history_s,
        "wall_s": time.time() - start,
        "decode_steps": figures["rollout/decode_steps"],
        "tokens": s["rollout/tokens"],
        "acceptance": figures.get("rollout/spec_acceptance", 0.0),
        "tokens_per_verify_step": figures.get("rollout/spec_tokens_per_verify_step", 1.0),
        "fed_per_emitted": figures.get("rollout/spec_fed_per_emitted", 1.0),
        "draft_s": figures.get("rollout/spec_draft_s", 0.0),
        "index_s": figures.get("rollout/spec_index_s", 0.0),
        "history_s": history_s,
        "indexed_tokens": figures.get("rollout/spec_indexed_tokens", 0),
        "rows": {(r.group_id, r.sample_index): tuple(r.completion_token_ids) for r in result.rows},
    }


def throughput(storage: str, config, run: dict, batch: int, speculative: bool, samples: int, live) -> dict:
    """A fixed set of the preset's prompts (``samples`` samples), all generated at ``max_batch`` = ``batch``."""
    import itertools

    from models.engines.types import GroupRequest, SamplingParams
    from models.prompt import encode_prompt
    from storage import checkpoints
    from storage.paths import StorageRoot
    from tasks.prompts.sources import prompt_stream
    from tasks.rollout.speculation import RoundSpeculation

    root = StorageRoot.of(storage)
    last = run["rounds"][-1]
    rc = config.round
    local = checkpoints.local_copy(root, last["checkpoint"])
    engine, tokenizer, _ = live.serve(
        "embedded", local, dtype=rc.rollout.dtype, policy_version=last["round"], max_batch=batch
    )
    engine.configure(batch, rc.rollout.update_kv)
    settings = rc.rollout.speculative.model_copy(update={"enabled": speculative})
    n = rc.rollout.samples_per_prompt
    prompts = list(itertools.islice(prompt_stream(rc.prompts, 7), max(1, samples // n)))
    sampling = SamplingParams(rc.rollout.temperature, rc.rollout.top_p, rc.rollout.max_tokens, seed=7)
    groups = [GroupRequest(f"t{i}", encode_prompt(tokenizer, p)[1], n, sampling) for i, p in enumerate(prompts)]
    speculation = RoundSpeculation(engine, settings, root, run["run_id"], last["round"] + 1)
    began = time.perf_counter()
    tokens = sum(len(s.token_ids) for s in engine.generate(groups))
    seconds = time.perf_counter() - began
    figures = speculation.finish()
    return {
        "tokens_per_s": tokens / seconds,
        "decode_steps": figures["rollout/decode_steps"],
        "tokens": tokens,
        "acceptance": figures.get("rollout/spec_acceptance", 0.0),
        "drafted": figures.get("rollout/spec_drafted_tokens", 0),
    }


def ratio(a: float, b: float) -> float | None:
    return a / b if a and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", default="./rlrounds-bench", help="storage root (campaigns are kept there)")
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument(
        "--config",
        help="a campaign config file laid over each preset, as with 'rlrounds run --config' (for example other "
        "round.rollout.speculative settings; 'enabled' is set by the benchmark)",
    )
    parser.add_argument("--rounds", type=int, default=12, help="campaign rounds before measuring (at least 10)")
    parser.add_argument("--repeats", type=int, default=2, help="collection rounds per mode, alternating")
    parser.add_argument(
        "--campaign-rounds",
        type=int,
        default=None,
        help="long-tail: rounds of the speculative campaign (default --rounds)",
    )
    parser.add_argument("--target", type=float, default=0.7, help="long-tail: held-out accuracy the campaigns race to")
    parser.add_argument("--quick", action="store_true", help="one preset (long-tail), one repeat, no learning part")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    from flows.cli import quiet_libraries
    from flows.orphans import take_over

    quiet_libraries(debug=False)
    from flows.config import load_campaign_config

    take_over(os.path.basename(__file__))
    os.environ["RLROUNDS_STORAGE"] = args.storage
    presets = ["long-tail"] if args.quick else args.presets.split(",")
    repeats = 1 if args.quick else args.repeats
    figures: dict = {"rounds": args.rounds, "presets": {}}
    from tasks.serving.live import LiveEngines

    live = LiveEngines()  # one engine per checkpoint shape across the runs below, as a campaign keeps it
    for preset in presets:
        config = load_campaign_config(args.config, None if preset == "default" else preset)
        config = config.model_copy(update={"round": config.round.model_copy(update={"seed": args.seed})})
        run_id = f"spec-bench-{preset}-s{args.seed}"
        print(f"{preset}: campaign {run_id}, {args.rounds} rounds, speculation off", flush=True)
        off = campaign(args.storage, config, run_id, args.rounds, speculative=False)
        per_mode: dict[str, list[dict]] = {"plain": [], "speculative": []}
        for repeat in range(repeats):
            for mode in ("plain", "speculative") if repeat % 2 == 0 else ("speculative", "plain"):
                r = collection(args.storage, config, off, mode == "speculative", live)
                per_mode[mode].append(r)
                print(
                    f"  collection {mode:11s}: {r['time_to_trainable_batch_s']:6.2f} s to a trainable batch, "
                    f"{r['decode_steps']:5d} decode steps, acceptance {r['acceptance']:.1%}, "
                    f"{r['tokens_per_verify_step']:.2f} tokens per verification step "
                    f"({r['fed_per_emitted']:.2f} fed per token emitted), drafting {r['draft_s']:.2f} s, "
                    f"indexing {r['index_s']:.2f} s ({r['indexed_tokens']} tokens)",
                    flush=True,
                )
        same = [
            sum(a["rows"].get(k) == v for k, v in b["rows"].items()) / max(len(b["rows"]), 1)
            for a, b in zip(per_mode["plain"], per_mode["speculative"])
        ]
        mean = {
            mode: {k: statistics.fmean(r[k] for r in runs) for k in runs[0] if k != "rows"}
            for mode, runs in per_mode.items()
        }
        entry = {
            "collection": mean,
            "rows_identical_share": same,
            "decode_steps_ratio": ratio(mean["plain"]["decode_steps"], mean["speculative"]["decode_steps"]),
            "time_to_trainable_batch_ratio": ratio(
                mean["plain"]["time_to_trainable_batch_s"], mean["speculative"]["time_to_trainable_batch_s"]
            ),
        }
        print(
            f"  plain / speculative: decode steps {entry['decode_steps_ratio']:.2f}x (goal >= 2x on long-tail), "
            f"time to a trainable batch {entry['time_to_trainable_batch_ratio']:.2f}x (goal >= 1.3x on long-tail); "
            f"rows identical {', '.join(f'{x:.1%}' for x in same)}",
            flush=True,
        )
        sizes = [b for b in BATCH_SIZES if b < config.round.rollout.max_batch] + [config.round.rollout.max_batch]
        entry["throughput"] = {}
        for batch in sizes:
            samples = 64 if batch == 1 else 512
            plain = throughput(args.storage, config, off, batch, False, samples, live)
            spec = throughput(args.storage, config, off, batch, True, samples, live)
            entry["throughput"][str(batch)] = {"plain": plain, "speculative": spec}
            print(
                f"  max_batch {batch:4d}: {plain['tokens_per_s']:8.0f} / {spec['tokens_per_s']:8.0f} tokens/s "
                f"({ratio(spec['tokens_per_s'], plain['tokens_per_s']):.2f}x), decode steps {plain['decode_steps']} / "
                f"{spec['decode_steps']} ({ratio(plain['decode_steps'], spec['decode_steps']):.2f}x)",
                flush=True,
            )
        if preset == "long-tail" and not args.quick:
            rounds = args.campaign_rounds or args.rounds
            print(f"{preset}: the same campaign with speculation on, {rounds} rounds", flush=True)
            on = campaign(args.storage, config, f"{run_id}-speculative", rounds, speculative=True)
            race = entry["learning"] = learning(off, on, args.target)
            print(
                f"  held-out accuracy per round, off / on: {race['accuracy_pairs']}; "
                f"first >= {args.target:.0%} at round {race['off_round_to_target']} / {race['on_round_to_target']} "
                f"(goal: on no later); seconds of rounds {_seconds(race['off_seconds'])} / "
                f"{_seconds(race['on_seconds'])}",
                flush=True,
            )
        figures["presets"][preset] = entry
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2, default=str)


def _seconds(value: float | None) -> str:
    return "n/a (campaign reused)" if value is None else f"{value:.0f}"


def learning(off: dict, on: dict, target: float) -> dict:
    rounds = min(len(off["rounds"]), len(on["rounds"]))

    def first(history: list[dict]) -> int | None:
        return next((e["round"] for e in history[1:] if e["accuracy"] >= target), None)

    pairs = [(off["rounds"][k]["accuracy"], on["rounds"][k]["accuracy"]) for k in range(1, rounds)]
    return {
        "accuracy_pairs": [f"{a:.3f}/{b:.3f}" for a, b in pairs],
        "max_accuracy_difference": max((abs(a - b) for a, b in pairs), default=0.0),
        "off_round_to_target": first(off["rounds"]),
        "on_round_to_target": first(on["rounds"]),
        # a campaign reused from an earlier run resumes past every round: its rounds' seconds are not measured again
        "off_seconds": None if off["reused"] else sum(e["seconds"] for e in off["rounds"][1:rounds]),
        "on_seconds": None if on["reused"] else sum(e["seconds"] for e in on["rounds"][1:rounds]),
    }


if __name__ == "__main__":
    main()
