"""Memory of a real-size policy's training round: peak resident memory and seconds per stage, each
configuration in a fresh process.

    python benchmarks/memory.py [--quick] [--configs full,full-gc,...] [--json OUT]

The policy is Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads of which 2 key/value, MLP 4864,
vocabulary 151,936, tied embeddings) with random weights: memory and time depend on the shape, not the
weights, and no checkpoint can be downloaded here. Its tokenizer is a word-level one built with
``tokenizers`` over placeholder tokens, padded to the vocabulary. ``--quick`` shrinks it to 4 layers of
width 256 (the vocabulary stays) for a run of a few minutes.

A train configuration is one round's training stage as ``tasks.train.stage.train_here`` runs it: load the
parent checkpoint, one optimizer step over ``--prompts`` x ``--samples`` rows with prompts of 24 tokens and
completions of ``--tokens``, in micro-batches of ``--microbatch`` tokens, then save the new checkpoint and
optimizer state. Its peak is the process's ru_maxrss; its stages are timed inside. The defaults (2 x 4 rows
of 32 tokens, micro-batches of 256) keep each train configuration to a few minutes on 2 cores: at this shape
an idle 2-core AVX-512 CPU trains about 19 tokens a second (27-30 with LoRA), so a round of 16 x 4 x 128
tokens (``--prompts 16 --tokens 128``, 9,728 tokens) trains for 5-9 minutes and runs for 9-12 minutes a
configuration. Micro-batches, not the round, set the peak (``full-gc-2x``).
Configurations:

    full, full-gc        full fine-tuning, micro-batches of --microbatch tokens, without / with gradient
                         checkpointing
    full-gc-2x           full-gc with twice the prompts: micro-batches, not the round, should set the peak
    lora, lora-gc        LoRA adapters (rank 16 on every projection), when models/memory.py offers them
    score-32k, score-152k  one no-gradient scoring pass (``completion_logprobs``) over 16 x 4 rows of 128
                         tokens (``--score-prompts``, ``--score-tokens``) at vocabulary 32k and 152k, 2
                         layers: its peak above the loaded model should not depend on the vocabulary
                         (once the logits outgrow ``LOGITS_BUDGET``: far fewer rows are scored whole)
    score-32k-whole      the same at 32k with the whole logits (the computation before the logits budget)
    round-full-gc, round-lora-gc, round-full, round-lora
                         a whole round in one process, stage by stage as a round runs them: rollout (the
                         embedded engine at float32 samples --prompts x --samples completions of exactly --tokens
                         tokens), train (train_here over those rows, the engine still held), publish (the live
                         engine loads the new checkpoint) and evaluate (a bfloat16 engine answers the prompts
                         greedily). Per stage: seconds and peak RSS (VmHWM, reset at the stage's start).
                         ``--configs round-full-gc,round-lora-gc --prompts 16 --tokens 128``: 16 x 4 x 128 tokens.

Figures are printed as a table and written with ``--json``; ratios are taken within the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time

SHAPES = {  # hidden, layers, heads, kv heads, MLP
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864),
    "quick": (256, 4, 4, 2, 1024),
}
VOCAB = 151_936
TRAIN_CONFIGS = ("full", "full-gc", "full-gc-2x", "lora", "lora-gc")
SCORE_CONFIGS = ("score-32k", "score-152k", "score-32k-whole")
ROUND_CONFIGS = ("round-full-gc", "round-lora-gc", "round-full", "round-lora")
STAGES = ("rollout", "train", "publish", "evaluate")


def build_policy(directory: str, shape: tuple, vocab: int, seed: int = 0) -> int:
    """A random Qwen2 of ``shape`` and ``vocab`` saved as a Hugging Face directory; returns its parameter count."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from models.checkpoint import save_policy

    hidden, layers, heads, kv_heads, mlp = shape
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Qwen2ForCausalLM(config)
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocabulary = {token: i for i, token in enumerate(specials + [f"t{i}" for i in range(vocab - len(specials))])}
    core = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    save_policy(model, tokenizer, directory)
    return sum(p.numel() for p in model.parameters())


def synthetic_rows(prompts: int, samples: int, tokens: int, vocab: int, seed: int = 0) -> list[dict]:
    """Kept rows of ``prompts`` groups: 24-token prompts, completions of ``tokens`` tokens, +-1 advantages."""
    rng = random.Random(seed)
    rows = []
    for g in range(prompts):
        prompt = [1] + [rng.randrange(4, vocab) for _ in range(23)]
        for s in range(samples):
            completion = [rng.randrange(4, vocab) for _ in range(tokens)]
            rows.append(
                {
                    "group_id": f"g{g}",
                    "prompt_token_ids": prompt,
                    "completion_token_ids": completion,
                    "rollout_logprobs": [-12.0 + rng.uniform(-0.1, 0.1) for _ in completion],
                    "advantage": 1.0 if s % 2 else -1.0,
                    "token_policy_versions": [0] * len(completion),
                    "sampling": {"top_p": 1.0, "max_tokens": tokens},
                    "engine": {"name": "embedded", "dtype": "float32"},
                }
            )
    return rows


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS: now, VmHWM: the peak since the last reset)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    """Start VmHWM again from the current resident size (Linux: writing 5 to clear_refs), so a peak read
    afterwards is the scoring's, not the model loading's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def train_config(spec: dict):
    """One optimizer step over all of a configuration's rows, in its micro-batches, with or without
    checkpointing and LoRA (rank 16, alpha 32 on every projection)."""
    from tasks.config.train import TrainConfig

    train = {
        "groups_per_step": spec["prompts"],
        "steps_per_round": 1,
        "epochs": 1,
        "max_kl": None,
        "recompute_proximal": "never",
        "max_tokens_per_microbatch": spec["microbatch"],
        "gradient_checkpointing": spec["gc"],
    }
    if spec["lora"]:
        train["lora"] = {"rank": 16, "alpha": 32}
    return TrainConfig(**train)


def kept_rows(samples: list, dtype: str) -> list[dict]:
    """An engine's samples as a round's kept rows, advantages alternating +1 and -1 within each group."""
    return [
        {
            "group_id": s.group_id,
            "prompt_token_ids": list(s.prompt_token_ids),
            "completion_token_ids": list(s.token_ids),
            "rollout_logprobs": list(s.logprobs),
            "advantage": 1.0 if s.sample_index % 2 else -1.0,
            "token_policy_versions": [0] * len(s.token_ids),
            "sampling": {"top_p": 1.0, "max_tokens": len(s.token_ids)},
            "engine": {"name": "embedded", "dtype": dtype},
        }
        for s in samples
    ]


def train_stage(spec: dict, rows: list[dict], out: str, recompute: bool) -> dict:
    """The train stage's own function over ``rows`` on the CPU (one optimizer step, ``train_config``); the new
    checkpoint is written into ``out``. Returns the stage's stats."""
    import torch

    from tasks.train import stage
    from tasks.train.policy_update import minibatches

    config = train_config(spec)
    batches = minibatches(rows, config.groups_per_step, config.steps_per_round)
    stats, _ = stage.train_here(
        spec["policy"],
        None,
        batches,
        config=config,
        temperature=1.0,
        current_version=0,
        recompute=[recompute],
        out=out,
        device=torch.device("cpu"),
        precision="fp32",
        progress=None,
    )
    return stats


def run_train(spec: dict) -> dict:
    """One train configuration, in this (fresh) process: the train stage's own function."""
    import torch

    torch.set_num_threads(spec["threads"])
    rows = synthetic_rows(spec["prompts"], spec["samples"], spec["tokens"], spec["vocab"])
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="rlrounds-memory-") as out:
        started = time.perf_counter()
        stats = train_stage(spec, rows, out, recompute=False)
        timings["train_s"] = stats["train/update_s"]
        timings["stage_s"] = time.perf_counter() - started  # load + update + save
    return {"peak_bytes": peak_bytes(), **timings, "loss": stats["train/loss"]}


def run_round(spec: dict) -> dict:
    """A whole round in this (fresh) process, stage by stage: each stage's seconds and peak RSS."""
    import torch

    from models.engines.types import GroupRequest, SamplingParams
    from tasks.serving.engines import make_engine

    torch.set_num_threads(spec["threads"])
    rng = random.Random(0)
    prompts = [tuple([1] + [rng.randrange(4, spec["vocab"]) for _ in range(23)]) for _ in range(spec["prompts"])]
    figures: dict[str, float] = {}

    def timed(name: str):
        print(f"{name}: started", file=sys.stderr, flush=True)
        reset_peak()
        started = time.perf_counter()

        def done() -> None:
            figures[f"{name}_s"] = time.perf_counter() - started
            figures[f"{name}_peak_bytes"] = status_bytes("VmHWM")
            print(
                f"{name}: {figures[f'{name}_s']:.1f} s, peak {figures[f'{name}_peak_bytes'] / 2**30:.2f} GiB",
                file=sys.stderr,
                flush=True,
            )

        return done

    done = timed("rollout")
    engine, _ = make_engine("embedded", spec["policy"], dtype="float32", policy_version=0, max_batch=256, device="cpu")
    params = SamplingParams(temperature=1.0, max_tokens=spec["tokens"], seed=0, ignore_eos=True)
    samples = list(engine.generate([GroupRequest(f"g{i}", p, spec["samples"], params) for i, p in enumerate(prompts)]))
    done()
    rows = kept_rows(samples, "float32")
    with tempfile.TemporaryDirectory(prefix="rlrounds-memory-round-") as out:
        done = timed("train")
        stats = train_stage(spec, rows, out, recompute=True)
        done()
        done = timed("publish")
        engine.load_weights(out, policy_version=1)
        done()
        del engine
        done = timed("evaluate")
        serving, _ = make_engine("embedded", out, dtype="bfloat16", policy_version=1, max_batch=256, device="cpu")
        greedy = SamplingParams(temperature=0.0, max_tokens=spec["tokens"], ignore_eos=True)
        answers = list(serving.generate([GroupRequest(f"e{i}", p, 1, greedy) for i, p in enumerate(prompts)]))
        done()
    return {
        "peak_bytes": max(figures[f"{name}_peak_bytes"] for name in STAGES),  # each reset clears ru_maxrss too
        **figures,
        "rows": len(rows),
        "tokens": sum(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in rows),
        "update_s": stats["train/update_s"],
        "mismatch_mean_abs": stats["train/mismatch_mean_abs"],
        "answers": len(answers),
    }


def run_score(spec: dict) -> dict:
    """One no-gradient scoring pass over the round's rows; its peak above the loaded model."""
    import torch

    from models.checkpoint import load_policy
    from models.logprobs import LOGITS_BUDGET, completion_logprobs, pack_shared

    torch.set_num_threads(spec["threads"])
    model, tokenizer = load_policy(spec["policy"])
    rows = synthetic_rows(spec["prompts"], spec["samples"], spec["tokens"], spec["vocab"])
    batch = pack_shared([r["prompt_token_ids"] for r in rows], [r["completion_token_ids"] for r in rows], 0)
    with torch.no_grad():  # read every weight once: a weight first read by the pass would count as the pass's
        for parameter in model.parameters():
            parameter.sum()
    loaded = status_bytes("VmRSS")
    reset_peak()
    budget = 1 << 62 if spec["whole"] else LOGITS_BUDGET
    started = time.perf_counter()
    with torch.no_grad():
        scores = completion_logprobs(model, batch, 1.0, None, None, logits_budget=budget)
    seconds = time.perf_counter() - started
    scoring_peak = status_bytes("VmHWM")
    return {
        "peak_bytes": peak_bytes(),
        "loaded_bytes": loaded,
        "above_model_bytes": scoring_peak - loaded,
        "score_s": seconds,
        "checksum": float(scores.sum()),
    }


def measure(name: str, spec: dict) -> dict:
    """Run one configuration in a fresh interpreter; its figures."""
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, __file__, "--child", json.dumps(spec)]
    print(f"{name}: running in a fresh process", file=sys.stderr, flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=env)  # its progress shows on stderr
    if done.returncode != 0:
        return {"config": name, "error": f"exited with {done.returncode}; its error is printed above"}
    return {"config": name, **json.loads(done.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 layers of width 256 (the vocabulary stays)")
    parser.add_argument("--configs", default=",".join(TRAIN_CONFIGS + SCORE_CONFIGS))
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--microbatch", type=int, default=256, help="train.max_tokens_per_microbatch")
    parser.add_argument("--score-prompts", type=int, default=16)
    parser.add_argument("--score-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        run = {"score": run_score, "train": run_train, "round": run_round}[spec["kind"]]
        print(json.dumps(run(spec)))
        return

    shape = SHAPES["quick" if args.quick else "qwen2.5-0.5b"]
    wanted = args.configs.split(",")
    common = {"prompts": args.prompts, "samples": args.samples, "tokens": args.tokens, "threads": args.threads}
    results = []
    with tempfile.TemporaryDirectory(prefix="rlrounds-memory-policy-") as tmp:
        policies: dict[tuple, str] = {}

        def policy(layers_shape: tuple, vocab: int) -> str:
            key = (layers_shape, vocab)
            if key not in policies:
                policies[key] = os.path.join(tmp, f"policy-{len(policies)}")
                count = build_policy(policies[key], layers_shape, vocab)
                print(f"built a random Qwen2 {layers_shape} vocab {vocab}: {count / 1e6:.0f}M parameters", flush=True)
            return policies[key]

        for name in wanted:
            if name in TRAIN_CONFIGS:
                spec = {
                    **common,
                    "kind": "train",
                    "policy": policy(shape, VOCAB),
                    "vocab": VOCAB,
                    "microbatch": args.microbatch,
                    "gc": name.endswith("gc") or "-gc-" in name,
                    "lora": name.startswith("lora"),
                }
                if name.endswith("-2x"):
                    spec["prompts"] = 2 * args.prompts
            elif name in SCORE_CONFIGS:
                vocab = 32_000 if "32k" in name else VOCAB
                hidden, _, heads, kv_heads, mlp = shape
                spec = {
                    **common,
                    "prompts": args.score_prompts,
                    "tokens": args.score_tokens,
                    "kind": "score",
                    "policy": policy((hidden, 2, heads, kv_heads, mlp), vocab),
                    "vocab": vocab,
                    "whole": name.endswith("whole"),
                }
            elif name in ROUND_CONFIGS:
                spec = {
                    **common,
                    "kind": "round",
                    "policy": policy(shape, VOCAB),
                    "vocab": VOCAB,
                    "microbatch": args.microbatch,
                    "gc": name.endswith("-gc"),
                    "lora": "lora" in name,
                }
            else:
                known = TRAIN_CONFIGS + SCORE_CONFIGS + ROUND_CONFIGS
                raise SystemExit(f"unknown configuration {name!r}; choose from {known}")
            result = measure(name, spec)
            results.append(result)
            print(json.dumps(result), flush=True)

    print(f"\n{cpu_name()}, {args.threads} threads, shape {shape}, vocab {VOCAB}")
    rows = f"{args.prompts} x {args.samples} rows of 24 + {args.tokens} tokens"
    scoring = f"{args.score_prompts} x {args.samples} rows of 24 + {args.score_tokens} tokens"
    print(f"train: {rows}, micro-batches of {args.microbatch}; scoring (2 layers): {scoring}")
    print(f"{'config':<18}{'peak GiB':>10}{'above model GiB':>17}{'train s':>9}{'stage s':>9}{'score s':>9}")
    gib = 1 << 30
    for r in results:
        if "error" in r:
            print(f"{r['config']:<18}  failed: {r['error']}")
            continue
        above = f"{r['above_model_bytes'] / gib:17.2f}" if "above_model_bytes" in r else " " * 17
        cells = "".join(f"{r[k]:9.1f}" if k in r else " " * 9 for k in ("train_s", "stage_s", "score_s"))
        print(f"{r['config']:<18}{r['peak_bytes'] / gib:10.2f}{above}{cells}")
    whole_rounds = [r for r in results if "error" not in r and "rollout_s" in r]
    if whole_rounds:
        print(f"\nwhole rounds: {args.prompts} x {args.samples} x {args.tokens} tokens; per stage: seconds / peak GiB")
        print(f"{'config':<18}" + "".join(f"{stage:>18}" for stage in STAGES) + f"{'process peak':>14}")
        for r in whole_rounds:
            cells = "".join(f"{r[stage + '_s']:9.1f} / {r[stage + '_peak_bytes'] / gib:5.2f}" for stage in STAGES)
            print(f"{r['config']:<18}{cells}{r['peak_bytes'] / gib:14.2f}")
    peaks = {r["config"]: r for r in results if "error" not in r}
    ratios = {}
    if "lora" in peaks and "full" in peaks:
        ratios["lora_over_full_peak"] = peaks["lora"]["peak_bytes"] / peaks["full"]["peak_bytes"]
    if "lora-gc" in peaks and "full-gc" in peaks:
        ratios["lora_gc_over_full_gc_peak"] = peaks["lora-gc"]["peak_bytes"] / peaks["full-gc"]["peak_bytes"]
    if "full-gc-2x" in peaks and "full-gc" in peaks:
        ratios["rows_doubled_peak"] = peaks["full-gc-2x"]["peak_bytes"] / peaks["full-gc"]["peak_bytes"]
    if "round-lora-gc" in peaks and "round-full-gc" in peaks:
        ratios["round_lora_gc_over_full_gc_peak"] = (
            peaks["round-lora-gc"]["peak_bytes"] / peaks["round-full-gc"]["peak_bytes"]
        )
    if "score-152k" in peaks and "score-32k" in peaks:
        ratios["score_152k_over_32k_above_model"] = (
            peaks["score-152k"]["above_model_bytes"] / peaks["score-32k"]["above_model_bytes"]
        )
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"shape": shape, "vocab": VOCAB, "threads": args.threads, "results": results, **ratios}, f, indent=2
            )


if __name__ == "__main__":
    main()
