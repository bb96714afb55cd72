"""A weight update in flight, two ways: what it costs the engine and what it does to the behaviour logprobs.

    python benchmarks/weight_update.py --old CHECKPOINT_DIR --new CHECKPOINT_DIR [--groups 512] [--repeats 3]
        [--device auto]

``--old`` and ``--new``: two local checkpoints of one campaign, consecutive rounds for a realistic step
(e.g. STORAGE/runs/RUN_ID/rounds/1/checkpoint and .../2/checkpoint). The embedded engine samples the
default task's prompts (--groups x 8 samples, all at once) under ``--old`` and takes ``--new`` after
the first decode step, so every sample spans the update (its first token is the old policy's, the rest
the new one's), once with each ``rollout.update_kv``.

- recompute: the sequences in flight are prefilled again under the new weights;
- keep: their KV cache from the old weights is kept.

Per mode it prints the engine's pause at the update (median over --repeats), and, over the tokens
sampled after the update by samples that span it, the gap between the recorded behaviour logprob and
the same token's logprob recomputed from scratch under the version it is labelled with: mean and max
|difference|, and the k3 estimate of KL(recorded || recomputed). The tokens before the update give the
numerical floor. Both modes draw the same samples up to the update; the trainer's importance weights
correct a mismatch only if the recorded logprobs are what the labelled version gives.

The engine runs on ``--device``; the from-scratch recomputation on the CPU, so on a GPU the floor also holds
the two devices' rounding.
"""

from __future__ import annotations

import argparse
import math
import statistics

from models.checkpoint import load_policy
from models.device import resolve_device
from models.engines.embedded import EmbeddedEngine
from models.engines.types import GroupRequest, SamplingParams
from models.logprobs import logprobs_by_version
from tasks.config.prompts import PromptsConfig
from tasks.prompts.sources import prompt_stream
from tasks.rollout.overlap import UpdateAtStep


def measure(old: str, new: str, update_kv: str, groups: int, seed: int, device: str = "auto") -> dict:
    model, tok = load_policy(old, device=resolve_device(device))
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, groups * 8, 1, update_kv)  # type: ignore[arg-type]
    stream = prompt_stream(PromptsConfig(), seed)
    params = SamplingParams(1.0, 1.0, 8, seed)
    requests = [GroupRequest(f"g{i}", tuple(tok(next(stream).text)["input_ids"]), 8, params) for i in range(groups)]
    update = UpdateAtStep(new, 2, step=2)
    samples = list(engine.generate(requests, None, update))
    spanning = [s for s in samples if len(set(s.token_policy_versions)) == 2]
    recomputed = logprobs_by_version({1: load_policy(old)[0], 2: load_policy(new)[0]}, spanning, tok.pad_token_id)
    after, before = [], []
    for s, expected in zip(spanning, recomputed):
        for got, want, version in zip(s.logprobs, expected, s.token_policy_versions):
            (after if version == 2 else before).append((got, want))
    gaps = [abs(g - w) for g, w in after]
    # k3 of KL(recorded || recomputed) over tokens drawn from the recorded distribution: r - 1 - log r
    k3 = [math.exp(w - g) - 1 - (w - g) for g, w in after]
    return {
        "pause_s": update.pause_s,
        "samples": len(samples),
        "spanning_samples": len(spanning),
        "tokens_after_update": len(after),
        "mean_abs_gap": statistics.fmean(gaps) if gaps else 0.0,
        "max_abs_gap": max(gaps, default=0.0),
        "k3_kl": statistics.fmean(k3) if k3 else 0.0,
        "floor_max_abs_gap": max((abs(g - w) for g, w in before), default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the checkpoint the engine starts with")
    parser.add_argument("--new", required=True, help="the checkpoint it takes mid-generation")
    parser.add_argument("--groups", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="the engine's: auto, cpu, cuda or cuda:N")
    args = parser.parse_args()
    results = {}
    for mode in ("recompute", "keep"):
        runs = [measure(args.old, args.new, mode, args.groups, args.seed, args.device) for _ in range(args.repeats)]
        results[mode] = {**runs[-1], "pause_s": statistics.median(r["pause_s"] for r in runs)}
    print(f"{args.groups} groups x 8 samples, update after the first token; {args.repeats} repeats")
    print(
        f"  {'update_kv':10s} {'pause':>9s} {'spanning':>9s} {'mean |gap|':>11s} {'max |gap|':>10s} {'k3 KL':>10s}"
        f" {'floor':>9s}"
    )
    for mode, r in results.items():
        print(
            f"  {mode:10s} {r['pause_s']:7.3f} s {r['spanning_samples']:9d} {r['mean_abs_gap']:11.2e} "
            f"{r['max_abs_gap']:10.2e} {r['k3_kl']:10.2e} {r['floor_max_abs_gap']:9.1e}"
        )
    keep, recompute = results["keep"], results["recompute"]
    print(
        f"  pause, recompute / keep: {recompute['pause_s'] / max(keep['pause_s'], 1e-9):.2f}x; mean |gap| after "
        f"the update: keep {keep['mean_abs_gap']:.2e}, recompute {recompute['mean_abs_gap']:.2e} nats "
        f"(floor, decode against prefill: {recompute['floor_max_abs_gap']:.1e})"
    )


if __name__ == "__main__":
    main()
