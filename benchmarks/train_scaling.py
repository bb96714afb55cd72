"""Training at 1 and 2 workers: step time, tokens per second, what each worker holds, and whether the
2-worker update equals the 1-worker one, for the built-in policy and an ~85M Llama-shaped one.

    python benchmarks/train_scaling.py [--models builtin,llama-85m] [--steps 3] [--json OUT]

Each model is initialised at random (the figures depend on its shape, not its weights) and trained on
the same synthetic minibatches: ``--groups`` groups of ``--samples`` samples per step, prompts of the
addition task's length and completions of 1 to ``--tokens`` tokens. 1 worker is the round's own
process (``tasks.train.policy_update.train_policy``, with every core); 2 workers are two processes joined by gloo
and sharded with FSDP2 (``tasks.train.worker_group.train_in_processes``, the cores shared out), the code a
campaign's Ray worker group runs. Step time is the update's wall time over its optimizer steps (model
loading and checkpoint writing left out); the bytes are each worker's parameters, gradients and
optimizer state as its local shards hold them; equivalence is the largest and the mean absolute
difference between the two updates' weights. On a machine with 2 CPU cores, 2 workers cannot be faster
than 1 (the same arithmetic, plus the collectives): the figures show what sharding costs and saves.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import warnings

MODELS = {  # name: (hidden, layers, heads, ffn, groups per step, completion tokens)
    "builtin": (None, None, None, None, 64, 8),  # the built-in base's own shape
    "llama-85m": (768, 12, 12, 2048, 4, 16),
}


def save_model(directory: str, shape: tuple) -> int:
    import torch

    from models.builtin.base_policy import BaseRecipe, build_model
    from models.builtin.tokenizer import build_char_tokenizer
    from models.checkpoint import save_policy

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    hidden, layers, heads, ffn = shape
    recipe = BaseRecipe()
    if hidden is not None:
        recipe = BaseRecipe(hidden_size=hidden, num_layers=layers, intermediate_size=ffn, num_heads=heads)
    model = build_model(recipe, len(tokenizer), tokenizer)
    save_policy(model, tokenizer, directory)
    return sum(p.numel() for p in model.parameters())


def synthetic_rows(tokenizer, groups: int, samples: int, tokens: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for g in range(groups):
        prompt = tokenizer(f"{rng.randrange(100)}+{rng.randrange(100)}=")["input_ids"]
        for s in range(samples):
            completion = [rng.randrange(3, 12) for _ in range(rng.randrange(1, tokens + 1))]
            rows.append(
                {
                    "group_id": f"g{g}",
                    "prompt_token_ids": prompt,
                    "completion_token_ids": completion,
                    "rollout_logprobs": [-2.3] * len(completion),
                    "advantage": 1.0 if s % 2 else -1.0,
                    "token_policy_versions": [0] * len(completion),
                    "sampling": {"top_p": 1.0, "max_tokens": tokens},
                }
            )
    return rows


def one_worker(parent: str, rows: list[dict], config, device) -> tuple[dict, dict, dict]:
    """(stats, resident bytes, weights) of the update in this process, on ``device``."""
    from models.checkpoint import load_policy
    from models.device import resolve_precision
    from models.sharded import resident_bytes
    from tasks.train.policy_update import minibatches, train_policy

    model, tokenizer = load_policy(parent)
    model.to(device)
    batches = minibatches(rows, config.groups_per_step, config.steps_per_round)
    optimizer, stats = train_policy(
        model,
        tokenizer.pad_token_id,
        batches,
        config=config,
        temperature=1.0,
        optimizer=None,
        current_version=0,
        recompute=[False] * len(batches),
        device=device,
        precision=resolve_precision(config.precision, device),
    )
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return stats, resident_bytes(model, optimizer), weights


def two_workers(parent: str, rows: list[dict], config, device) -> tuple[dict, list[dict], dict]:
    """(stats, each rank's resident bytes, weights) of the update on 2 workers: gloo on CPUs, NCCL on 2 GPUs."""
    from safetensors.torch import load

    from tasks.train.policy_update import minibatches, sharded_minibatches
    from tasks.train.worker_group import TrainJob, train_in_processes

    steps = len(minibatches(rows, config.groups_per_step, config.steps_per_round))
    shares = sharded_minibatches(rows, config.groups_per_step, config.steps_per_round, None, 2)
    job = TrainJob(shares=[], config=config, temperature=1.0, current_version=0, recompute=[False] * steps)
    results = train_in_processes(2, parent, shares, job, device.type)
    weights = load(results[0].files["model.safetensors"])
    return results[0].stats, [r.memory for r in results], weights


def measure(name: str, steps: int, samples: int, device) -> dict:
    import torch

    from models.checkpoint import load_policy
    from tasks.config.train import TrainConfig

    hidden, layers, heads, ffn, groups, tokens = MODELS[name]
    with tempfile.TemporaryDirectory() as parent:
        params = save_model(parent, (hidden, layers, heads, ffn))
        _, tokenizer = load_policy(parent)
        rows = synthetic_rows(tokenizer, groups * steps, samples, tokens)
        trained = sum(len(r["completion_token_ids"]) for r in rows)
        # fp32 on every device: the equivalence check compares two fp32 updates
        config = TrainConfig(groups_per_step=groups, steps_per_round=steps, epochs=1, max_kl=None, precision="fp32")
        stats1, memory1, weights1 = one_worker(parent, rows, config, device)
        stats2, memory2, weights2 = two_workers(parent, rows, config, device)
    diffs = torch.cat([(weights1[k] - weights2[k]).abs().flatten() for k in weights1])
    row = {"model": name, "parameters": params, "steps": steps, "tokens_per_step": trained / steps}
    for workers, stats, memory in ((1, stats1, [memory1]), (2, stats2, memory2)):
        seconds = stats["train/update_s"]
        row[f"w{workers}"] = {
            "step_s": seconds / steps,
            "tokens_per_s": trained / seconds,
            "per_worker_bytes": memory,
            "loss": stats["train/loss"],
        }
    row["max_abs_diff"], row["mean_abs_diff"] = float(diffs.max()), float(diffs.mean())
    row["bytes_ratio"] = max(sum(m.values()) for m in memory2) / sum(memory1.values())
    row["step_time_ratio"] = row["w2"]["step_s"] / row["w1"]["step_s"]
    return row


def torch_gpu_name() -> str:
    import torch

    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per measurement")
    parser.add_argument("--samples", type=int, default=4, help="samples per group")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (2 workers on CUDA need 2 GPUs)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    from models.device import resolve_device

    hf_logging.set_verbosity_error()
    device = resolve_device(args.device)
    rows = []
    where = f"{os.cpu_count()} CPUs" if device.type == "cpu" else torch_gpu_name()
    print(f"# {platform.machine()}, {where}; 1 worker: every core, 2: one each (or a GPU each)")
    heads = ["model", "params", "tok/step", "step s 1w", "2w", "2w/1w", "tok/s 1w", "2w", "MiB 1w", "2w"]
    print(" ".join(f"{h:>9}" for h in heads), f"{'ratio':>6} {'max|d|':>9} {'mean|d|':>9}")
    for name in args.models.split(","):
        row = measure(name, args.steps, args.samples, device)
        rows.append(row)
        mib = [sum(m.values()) / 2**20 for m in row["w1"]["per_worker_bytes"] + row["w2"]["per_worker_bytes"]]
        print(
            f"{name:>9} {row['parameters'] / 1e6:8.2f}M {row['tokens_per_step']:9.0f} "
            f"{row['w1']['step_s']:9.3f} {row['w2']['step_s']:9.3f} {row['step_time_ratio']:9.2f} "
            f"{row['w1']['tokens_per_s']:9.0f} {row['w2']['tokens_per_s']:9.0f} "
            f"{mib[0]:9.1f} {max(mib[1:]):9.1f} {row['bytes_ratio']:6.2f} "
            f"{row['max_abs_diff']:9.2e} {row['mean_abs_diff']:9.2e}"
        )
        equal = row["max_abs_diff"] < 1e-5
        print(f"  equivalence (max |d| < 1e-5 after {args.steps} steps): {'yes' if equal else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
