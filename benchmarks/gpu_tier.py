"""The GPU tier's benchmark: one table of what a real-size policy costs on one device, with torch alone.

    python benchmarks/gpu_tier.py [--shape qwen2.5-0.5b] [--device cuda] [--prompts 16] [--samples 4]
                                  [--tokens 128] [--json OUT]

It needs only what the project's torch level needs (torch, transformers, peft, safetensors, pydantic and
pydantic-settings), none of Prefect, MLflow, Ray, vLLM or s3fs, so it runs on a GPU machine that reaches no
package registry once pydantic's wheels are carried there (``bash benchmarks/gpu_tier.sh``, docs/testing.md).

The policy has Qwen2.5-0.5B's shape (benchmarks/memory.py: hidden 896, 24 layers, vocabulary 151,936, tied
embeddings) with random weights. One round's shape of work on it:

1. **Engine**: the embedded engine serving at bfloat16 (as ``make_engine`` builds it for a round) samples
   ``--prompts`` x ``--samples`` completions of exactly ``--tokens`` tokens at temperature 1 from random
   24-token prompts. Generated tokens per second, after a warm-up call.
2. **Train step**: the samples as kept rows (advantages +-1), optimizer steps of ``train_policy`` over all of
   them (the second timed: the first warms the kernels up) at ``train.precision`` (default ``auto``: bf16
   autocast over fp32 weights on a GPU), in micro-batches of ``--microbatch`` tokens; full fine-tuning and LoRA
   (rank 16 on every projection), each on a fresh load. Tokens (prompt + completion) per second of the step, and
   the peak memory: ``torch.cuda.max_memory_allocated`` on a GPU, the process's peak RSS on the CPU.
3. **Alignment**: the engine's behaviour logprobs against the trainer's at the same weights
   (``train/mismatch_*``, as every round logs them): mean and largest absolute gap per token, and the KL
   estimate.

``--shape tiny --device cpu`` runs the same steps on a small policy in seconds (tests/test_gpu_tier.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project, not installed

import torch

from benchmarks.memory import SHAPES, VOCAB, build_policy, kept_rows

TINY = (64, 2, 4, 2, 128)  # hidden, layers, heads, kv heads, MLP
TINY_VOCAB = 4096
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=[*SHAPES, "tiny"], default="qwen2.5-0.5b")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="completion tokens per sample")
    parser.add_argument("--microbatch", type=int, default=4096, help="train.max_tokens_per_microbatch")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto", help="train.precision")
    parser.add_argument("--json", help="write the figures here as JSON")
    return parser.parse_args(argv)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB; the process's whole life


def sample(policy_dir: str, args, device: torch.device) -> tuple[list, dict]:
    """The engine's samples and its figures."""
    from models.engines.types import GroupRequest, SamplingParams
    from tasks.serving.engines import make_engine

    engine, tokenizer = make_engine(
        "embedded",
        policy_dir,
        dtype="bfloat16",
        policy_version=0,
        max_batch=args.prompts * args.samples,
        device=str(device),
    )
    vocab = len(tokenizer)
    rng = random.Random(0)
    prompts = [tuple([1] + [rng.randrange(4, vocab) for _ in range(23)]) for _ in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, seed=0, ignore_eos=True)
    warm = SamplingParams(temperature=1.0, max_tokens=4, seed=1, ignore_eos=True)
    list(engine.generate([GroupRequest("warm", prompts[0], 2, warm)]))
    synchronize(device)
    started = time.perf_counter()
    samples = list(engine.generate([GroupRequest(f"g{i}", p, args.samples, params) for i, p in enumerate(prompts)]))
    synchronize(device)
    seconds = time.perf_counter() - started
    generated = sum(len(s.token_ids) for s in samples)
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    del engine
    return samples, {"engine_seconds": seconds, "engine_tokens": generated, "engine_tokens_per_s": generated / seconds}


def train_step(policy_dir: str, rows: list[dict], args, device: torch.device, lora: bool) -> dict:
    """One optimizer step over every row, as a one-worker train stage runs it; its figures."""
    from models.checkpoint import load_policy
    from models.device import resolve_precision
    from models.memory import add_adapters
    from tasks.config.train import TrainConfig
    from tasks.train.policy_update import minibatches, train_policy

    config = TrainConfig(
        groups_per_step=args.prompts,
        steps_per_round=1,
        epochs=1,
        max_kl=None,
        max_tokens_per_microbatch=args.microbatch,
        precision=args.precision,
    )
    precision = resolve_precision(config.precision, device)
    reset_peak(device)
    model, tokenizer = load_policy(policy_dir, dtype="float32", device=device)
    if lora:
        model = add_adapters(model, rank=16, alpha=32, target_modules=LORA_TARGETS, seed=0).get_base_model()
    batches = minibatches(rows, config.groups_per_step, config.steps_per_round)

    def step(optimizer):
        return train_policy(
            model,
            tokenizer.pad_token_id,
            batches,
            config=config,
            temperature=1.0,
            optimizer=optimizer,
            current_version=0,
            recompute=[True] * len(batches),
            device=device,
            precision=precision,
        )

    optimizer, stats = step(None)  # at the sampling weights: the alignment; also warms the kernels up
    synchronize(device)
    started = time.perf_counter()
    step(optimizer)  # the timed step
    synchronize(device)
    seconds = time.perf_counter() - started
    tokens = sum(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in rows)
    figures = {
        "precision": precision,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "peak_gib": peak_gib(device),
        "mismatch_mean_abs": stats["train/mismatch_mean_abs"],
        "mismatch_max_abs": stats["train/mismatch_max_abs"],
        "mismatch_kl": stats["train/mismatch_kl"],
    }
    return figures


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"gpu_tier: torch {torch.__version__} sees no CUDA device; --device cpu runs the same steps here")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    shape, vocab = (TINY, TINY_VOCAB) if args.shape == "tiny" else (SHAPES[args.shape], VOCAB)
    with tempfile.TemporaryDirectory(prefix="rlrounds-gpu-tier-") as policy_dir:
        print(f"gpu_tier: building a random {args.shape} policy (vocabulary {vocab:,})", flush=True)
        parameters = build_policy(policy_dir, shape, vocab)
        print(f"gpu_tier: sampling {args.prompts} x {args.samples} x {args.tokens} tokens", flush=True)
        samples, engine = sample(policy_dir, args, device)
        rows = kept_rows(samples, "bfloat16")
        train = {}
        for name in ("full", "lora"):
            print(f"gpu_tier: one {name} train step over {len(rows)} rows", flush=True)
            train[name] = train_step(policy_dir, rows, args, device, lora=name == "lora")
    result = {
        "device": describe_device(device),
        "torch": torch.__version__,
        "shape": args.shape,
        "parameters": parameters,
        "vocab": vocab,
        "rows": len(rows),
        **engine,
        "train": train,
    }
    full, lora = train["full"], train["lora"]
    size = f"{parameters / 1e6:,.1f}M parameters"
    print(f"\nGPU tier: {result['device']}, torch {torch.__version__}, {args.shape} ({size})")
    print(f"{args.prompts} prompts x {args.samples} samples x {args.tokens} tokens; engine at bfloat16\n")
    print("| figure | value |")
    print("|---|---|")
    print(f"| engine tokens/s (generated) | {engine['engine_tokens_per_s']:,.0f} |")
    print(f"| train step tokens/s, full ({full['precision']}) | {full['tokens_per_s']:,.0f} |")
    print(f"| train step tokens/s, LoRA r16 ({lora['precision']}) | {lora['tokens_per_s']:,.0f} |")
    print(f"| peak memory GiB, full | {full['peak_gib']:.2f} |")
    print(f"| peak memory GiB, LoRA | {lora['peak_gib']:.2f} |")
    print(f"| LoRA / full peak | {lora['peak_gib'] / full['peak_gib']:.2f}x |")
    print(f"| engine vs trainer logprob, mean abs gap | {full['mismatch_mean_abs']:.2e} |")
    print(f"| engine vs trainer logprob, max abs gap | {full['mismatch_max_abs']:.2e} |")
    print(f"| engine vs trainer KL estimate | {full['mismatch_kl']:.2e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
