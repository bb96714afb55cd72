"""The tails of the long-tail preset, measured: base build, completion lengths, environment latency.

1. Base: builds the preset's base policy under ``--storage`` (or finds it cached) and prints its build
   seconds and greedy held-out accuracy, as recorded in its lineage.json.
2. Completion lengths on the base policy: ``--groups`` prompts from the preset's stream, sampled as the
   preset's rollout samples them (temperature, samples per prompt, max_tokens); p50/p90/p99/max in
   tokens (end-of-sequence included), the share cut at max_tokens, and p99 / p50; how far that ratio is
   from moving: the share of samples shorter than the median, and the share at least 8x the median; and
   the run-ons: wrong samples that end at least ``RUN_ON_TOKENS`` past the right answer's length.
   ``--temperature`` samples at another temperature than the preset's (how the tail depends on it).
3. Environment latency (a SIMULATION, tasks/verifiers/simulated_env.py): every one of those samples is
   verified through the preset's simulated environment in a real verifier pool; p50/p90/p99/max of the
   measured seconds per call, and p99 / p50.
4. Greedy held-out accuracy of the base by span (how many numbers past the first it must count down).

    python benchmarks/long_tail.py [--storage DIR] [--groups 1024] [--temperature T] [--device auto] [--json PATH]

The base build and the engine run on ``--device`` (auto: CUDA when visible, else the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

RUN_ON_TOKENS = 40
"""A wrong sample this many tokens past the right answer's length ran on (the task's answers differ
by four tokens a step, so this is ten numbers too many)."""


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:  # nearest-rank, as rollout_stats
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", default="./rlrounds-data", help="storage root whose base/ caches the base policy")
    parser.add_argument("--preset", default="long-tail")
    parser.add_argument("--groups", type=int, default=1024, help="prompts sampled (each samples_per_prompt times)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: the preset's)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (as a round's device)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    from pydantic import ValidationError

    from flows.config import describe_validation_error, load_campaign_config
    from models.engines.types import GroupRequest, SamplingParams
    from tasks.campaign.base_policy import run_prepare_base
    from tasks.prompts.sources import prompt_stream
    from tasks.serving.engines import make_engine
    from tasks.verifiers.pool import VerifierPool
    from tasks.verifiers.registry import rollout_verifier

    rc = load_campaign_config(None, args.preset).round
    if args.temperature is not None:  # checked by the rollout config's own bounds
        try:
            rollout = rc.rollout.model_validate({**rc.rollout.model_dump(), "temperature": args.temperature})
        except ValidationError as exc:
            parser.error(describe_validation_error(exc, None, type(rc.rollout)))
        rc = rc.model_copy(update={"rollout": rollout})
    start = time.perf_counter()
    base = run_prepare_base(
        storage=args.storage,
        base_model=rc.policy.base_model,
        progress=lambda m: print(f"  {m}", flush=True),
        device=args.device,
    )
    with open(os.path.join(base.checkpoint, "lineage.json")) as f:
        meta = json.load(f)
    figures: dict = {
        "base": {
            "name": base.base_model,
            "built_now": base.built,
            "build_seconds": meta["build_seconds"],
            "steps": meta["steps"],
            "held_out_accuracy": meta["held_out_accuracy"],
        }
    }
    print(
        f"base {base.base_model}: {'built' if base.built else 'cached'}, build {meta['build_seconds']} s "
        f"({meta['steps']} steps), greedy held-out accuracy {meta['held_out_accuracy']:.1%}"
        + (f"; this run {time.perf_counter() - start:.0f} s" if base.built else ""),
        flush=True,
    )

    engine, tokenizer = make_engine(
        rc.rollout.engine,
        base.checkpoint,
        dtype=rc.rollout.dtype,
        policy_version=0,
        max_batch=rc.rollout.max_batch,
        device=args.device,
    )
    temperature = rc.rollout.temperature
    sampling = SamplingParams(temperature, rc.rollout.top_p, rc.rollout.max_tokens, args.seed)
    stream = prompt_stream(rc.prompts, args.seed)
    prompts = {f"g{i}": next(stream) for i in range(args.groups)}
    requests = [
        GroupRequest(gid, tuple(tokenizer(p.text)["input_ids"]), rc.rollout.samples_per_prompt, sampling)
        for gid, p in prompts.items()
    ]
    start = time.perf_counter()
    samples = list(engine.generate(requests))
    gen_s = time.perf_counter() - start
    lengths = quantiles([len(s.token_ids) for s in samples])
    cut = sum(s.finish_reason == "length" for s in samples) / len(samples)
    figures["completion_tokens"] = {
        **lengths,
        "p99_over_p50": lengths["p99"] / lengths["p50"],
        "cut_at_max_tokens": cut,
        "samples": len(samples),
        "temperature": temperature,
        "max_tokens": rc.rollout.max_tokens,
    }
    print(
        f"completion tokens over {len(samples)} samples ({args.groups} prompts x {rc.rollout.samples_per_prompt}, "
        f"temperature {temperature}, max_tokens {rc.rollout.max_tokens}, {gen_s:.1f} s): "
        f"p50 {lengths['p50']} p90 {lengths['p90']} p99 {lengths['p99']} max {lengths['max']}; "
        f"p99/p50 {lengths['p99'] / lengths['p50']:.1f}; {cut:.1%} cut at max_tokens",
        flush=True,
    )

    # How far the ratio is from moving: the median drops once over half the samples are shorter than it,
    # and p99 reaches 8x the median once 1% of samples are that long.
    tokens = figures["completion_tokens"]
    tokens["share_below_p50"] = sum(len(s.token_ids) < lengths["p50"] for s in samples) / len(samples)
    tokens["share_at_least_8x_p50"] = sum(len(s.token_ids) >= 8 * lengths["p50"] for s in samples) / len(samples)
    print(
        f"samples shorter than the median: {tokens['share_below_p50']:.1%} (it drops at 50%); "
        f"at least 8x the median ({8 * lengths['p50']} tokens): {tokens['share_at_least_8x_p50']:.2%} "
        "(p99/p50 >= 8 at 1%)",
        flush=True,
    )
    texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
    right_length = {  # the right answer's tokens and end-of-sequence
        gid: len(tokenizer(p.reference, add_special_tokens=False)["input_ids"]) + 1 for gid, p in prompts.items()
    }
    wrong = [s for s, text in zip(samples, texts) if text != prompts[s.group_id].reference]
    run_ons = sum(len(s.token_ids) >= right_length[s.group_id] + RUN_ON_TOKENS for s in wrong)
    tokens["wrong_share"] = len(wrong) / len(samples)
    tokens["run_on_share"] = run_ons / len(samples)
    print(
        f"wrong samples: {tokens['wrong_share']:.1%}; run-ons (wrong, ending {RUN_ON_TOKENS}+ tokens past the right "
        f"answer's length): {tokens['run_on_share']:.1%} of all samples",
        flush=True,
    )

    env = rc.verify.simulated_environment
    verifier = rollout_verifier(rc.verifier, rc.verify, round_seed=args.seed)
    start = time.perf_counter()
    with VerifierPool(verifier, rc.verify.workers) as pool:
        futures = [pool.submit(text, prompts[s.group_id].reference) for s, text in zip(samples, texts)]
        verdicts = [f.result() for f in futures]
    verify_s = time.perf_counter() - start
    latency = quantiles([v.latency_s for v in verdicts])
    success = sum(v.reward == 1.0 for v in verdicts) / len(verdicts)
    figures["environment_latency_s"] = {
        **latency,
        "p99_over_p50": latency["p99"] / latency["p50"],
        "workers": rc.verify.workers,
        "simulated": env.model_dump() if env else None,
    }
    figures["sampled_success_rate"] = success
    print(
        f"environment latency (SIMULATED: {env.model_dump() if env else 'none'}), {rc.verify.workers} workers, "
        f"{verify_s:.1f} s: p50 {latency['p50'] * 1e3:.0f} ms p90 {latency['p90'] * 1e3:.0f} ms "
        f"p99 {latency['p99'] * 1e3:.0f} ms max {latency['max'] * 1e3:.0f} ms; "
        f"p99/p50 {latency['p99'] / latency['p50']:.1f}; "
        f"sampled success rate {success:.1%}",
        flush=True,
    )

    # 4. Where the base fails: greedy held-out accuracy by span (numbers counted down past the first).
    from models.builtin.longtail import held_out_prompts

    held_out = held_out_prompts()
    greedy = SamplingParams(0.0, 1.0, rc.evaluate.max_tokens, 0)
    requests = [GroupRequest(f"h{i}", tuple(tokenizer(p.text)["input_ids"]), 1, greedy) for i, p in enumerate(held_out)]
    answers = {s.group_id: tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in engine.generate(requests)}
    by_span: dict[str, list[int]] = {}
    for i, p in enumerate(held_out):
        start, stop = (int(x) for x in p.text.rstrip("=").split(">"))
        span = start - stop
        bucket = "1" if span == 1 else "2" if span == 2 else "3-4" if span <= 4 else "5-9" if span <= 9 else "10+"
        hits = by_span.setdefault(bucket, [0, 0])
        hits[0] += answers[f"h{i}"] == p.reference
        hits[1] += 1
    figures["greedy_accuracy_by_span"] = {k: {"correct": c, "prompts": n} for k, (c, n) in by_span.items()}
    print(
        f"greedy held-out accuracy by span ({rc.rollout.dtype}): "
        + ", ".join(f"{k}: {c}/{n}" for k, (c, n) in by_span.items()),
        flush=True,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
