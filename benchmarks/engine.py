"""Embedded engine vs transformers ``generate``: same model, same prompts, same sampling settings; and
the embedded engine's two KV caches (models/engines/kv_cache.py) against each other.

Three workloads, all sampled at temperature 1 with n samples per prompt:
- uniform:     every completion is exactly ``--tokens`` long (eos ignored by both engines);
- long-tailed: completions end at eos. The model is a randomly initialised Llama whose eos is drawn
               about once every vocabulary-size steps, so lengths are geometric: most short, a few long.
               ``generate`` keeps every row of a static batch computing until the longest finishes;
               the embedded engine retires each sequence when it ends.
- refilled tail: the long-tailed lengths through an engine of ``--tail-rows`` rows fed ``--tail-prompts``
               prompts, so rows join as others leave and most rows are short beside a few long ones
               (a long-tail rollout's shape);
- rollout:     the default round's shape: ``--rollout-prompts`` prompts x 4 samples, at most 8 tokens,
               eos-ended, through one engine of 1024 rows (rows leave and join all the time).
Figures are useful tokens (up to and including eos) per second, median of ``--repeats`` runs, and the
ratios embedded / generate and slots / padded, measured in this run, the runs of the engines interleaved.
``1-pass`` is the slot cache with its attention in one pass over every row's span (models/engines/kv_cache.py,
``attention_runs``, turned off): ``runs/1-pass`` is what attending in runs of similar length saves when
a few rows are long.
``generate`` is not asked for logprobs, the embedded engine always computes them. Both run on ``--device``
(auto: CUDA when visible, else the CPU).

Then the decode efficiency: the model FLOP/s the embedded engine reaches decoding ``--efficiency-rows`` rows
of ``--efficiency-tokens`` tokens each (eos ignored) at the built-in size and at a Llama of about 85M
parameters (hidden 768, 12 layers, MLP 2048), against the FLOP/s of one square float32 matrix product on the
same device, measured in this run. A model's FLOPs are counted as 2 per weight of every linear layer (the
LM head included, the embedding lookup not) and 4 x hidden per layer per position attended to, for every
prompt and sampled token the engine ran through the model. At the built-in size the engine is bound by
per-step work outside the model (sampling, bookkeeping, host syncs); at 85M by its matrix products.
``--only-efficiency`` prints that table alone.

    python benchmarks/engine.py [--prompts 32] [--samples 8] [--tokens 32] [--rollout-prompts 2048] [--repeats 3]
        [--device auto] [--only-efficiency] [--efficiency-rows 64] [--efficiency-tokens 64]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import warnings


def build_model(vocab_hidden=(16, 128), seed: int = 0, **shape):
    """A randomly initialised Llama of the built-in recipe's shape (``shape``: other BaseRecipe sizes)."""
    import torch

    from models.builtin.base_policy import BaseRecipe
    from models.builtin.base_policy import build_model as build
    from models.builtin.tokenizer import build_char_tokenizer

    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    model = build(BaseRecipe(**{"hidden_size": vocab_hidden[1], **shape}), len(tokenizer), tokenizer).eval()
    model.config.max_position_embeddings = 512
    return model, tokenizer


def prompts(count: int) -> list[str]:
    from models.builtin import addition

    return [p.text for p in addition.training_prompts(seed=123, count=count)]


def run_generate(model, tokenizer, texts, samples: int, tokens: int, uniform: bool) -> tuple[int, float]:
    import torch

    enc = tokenizer(texts, padding=True, return_tensors="pt").to(model.device)
    kwargs = {"min_new_tokens": tokens} if uniform else {}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=tokens,
            num_return_sequences=samples,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **kwargs,
        )
    elapsed = time.perf_counter() - start
    completions = out[:, enc["input_ids"].shape[1] :]
    useful = 0
    for row in completions.tolist():
        useful += row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
    return useful, elapsed


def run_embedded(
    model,
    tokenizer,
    texts,
    samples: int,
    tokens: int,
    uniform: bool,
    kv_cache: str = "slots",
    max_batch: int = 0,
    runs: bool = True,
) -> tuple[int, float]:
    from models.engines import kv_cache as caches
    from models.engines.embedded import EmbeddedEngine
    from models.engines.types import GroupRequest, SamplingParams

    caches.ATTEND_BLOCK_ROWS = ATTEND_BLOCK_ROWS if runs else 1 << 62
    engine = EmbeddedEngine(
        model,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        max_batch=max_batch or len(texts) * samples,
        kv_cache=kv_cache,
    )
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=tokens, seed=1, ignore_eos=uniform)
    requests = [GroupRequest(f"g{i}", tuple(tokenizer(t)["input_ids"]), samples, params) for i, t in enumerate(texts)]
    start = time.perf_counter()
    useful = sum(len(s.token_ids) for s in engine.generate(requests))
    return useful, time.perf_counter() - start


def _attend_block_rows() -> int:
    from models.engines.kv_cache import ATTEND_BLOCK_ROWS

    return ATTEND_BLOCK_ROWS


ATTEND_BLOCK_ROWS = _attend_block_rows()


def measure(runs: dict, repeats: int) -> dict[str, tuple[float, int]]:
    """Median tokens/s and tokens of each named run (a no-argument function), repeats interleaved so that
    a slow spell of a shared machine falls on every engine alike."""
    for fn in runs.values():
        fn()  # warm-up: first calls pay one-off allocation costs
    seen: dict[str, list[tuple[int, float]]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            seen[name].append(fn())
    return {name: (statistics.median(t / e for t, e in r), r[0][0]) for name, r in seen.items()}


SIZES = {  # name -> BaseRecipe sizes of the decode-efficiency table
    "built-in": {},
    "85M": {"hidden_size": 768, "num_layers": 12, "intermediate_size": 2048, "num_heads": 12},
}


def matmul_flops(device, size: int = 1024, repeats: int = 20) -> float:
    """FLOP/s of a [size, size] @ [size, size] float32 product on ``device``: the median of ``repeats`` timed ones."""
    import torch

    a, b = (torch.randn(size, size, device=device) for _ in range(2))
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times[1:])


def model_flops(model, prompt_lengths: list[int], tokens: int) -> float:
    """FLOPs of running every prompt and then ``tokens`` sampled tokens per row through ``model``, each
    position attending to every position before it and itself (``SIZES``' counting rule, see the module)."""
    import torch

    config = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    per_position = 4 * config.hidden_size * config.num_hidden_layers  # scores and values, per key attended to
    total = 0.0
    for length in prompt_lengths:
        positions = length + tokens - 1  # the last sampled token is never fed back
        total += positions * 2 * linear + per_position * positions * (positions + 1) / 2
    return total


def decode_efficiency(device, rows: int, tokens: int, repeats: int) -> None:
    """Print the decode-efficiency table (see the module's docstring)."""
    peak = matmul_flops(device)
    print(
        f"\ndecode efficiency: {rows} rows x {tokens} tokens (eos ignored), against a 1024^3 float32 matrix product "
        f"at {peak / 1e9:,.0f} GFLOP/s on this device"
    )
    print(f"{'model':<12}{'parameters':>12}{'tok/s':>12}{'model GFLOP/s':>16}{'of the product':>16}")
    for name, shape in SIZES.items():
        model, tokenizer = build_model(**shape)
        texts = prompts(rows)
        lengths = [len(tokenizer(t)["input_ids"]) for t in texts]
        model.config.max_position_embeddings = max(lengths) + tokens  # the slot cache holds no more than it needs
        model.to(device)
        run = functools.partial(run_embedded, model, tokenizer, texts, 1, tokens, True, "slots", rows)
        rate, useful = measure({name: run}, repeats)[name]
        seconds = useful / rate
        flops = model_flops(model, lengths, tokens) / seconds
        params = sum(p.numel() for p in model.parameters())
        print(f"{name:<12}{params / 1e6:>11.2f}M{rate:>12,.0f}{flops / 1e9:>16,.1f}{flops / peak:>15.1%}", flush=True)
        del model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens (uniform) / cap (long-tailed)")
    parser.add_argument("--tail-tokens", type=int, default=128, help="length cap for the long-tailed workload")
    parser.add_argument("--tail-prompts", type=int, default=512, help="prompts of the refilled-tail workload")
    parser.add_argument("--tail-rows", type=int, default=512, help="engine rows of the refilled-tail workload")
    parser.add_argument("--rollout-prompts", type=int, default=2048, help="prompts of the rollout workload")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (as a round's device)")
    parser.add_argument("--only-efficiency", action="store_true", help="print the decode-efficiency table alone")
    parser.add_argument("--efficiency-rows", type=int, default=64, help="rows decoded at once in that table")
    parser.add_argument("--efficiency-tokens", type=int, default=64, help="tokens each row decodes in that table")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    from transformers.utils import logging as hf_logging

    from models.device import resolve_device

    hf_logging.set_verbosity_error()
    device = resolve_device(args.device)
    if args.only_efficiency:
        decode_efficiency(device, args.efficiency_rows, args.efficiency_tokens, args.repeats)
        return
    model, tokenizer = build_model()
    model.to(device)
    texts = prompts(args.prompts)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: Llama {params / 1e6:.2f}M parameters, {args.prompts} prompts x {args.samples} samples, "
        f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads"
    )
    header = (
        ("generate tok/s", 15),
        ("padded tok/s", 14),
        ("slots tok/s", 13),
        ("1-pass tok/s", 14),
        ("emb/gen", 9),
        ("slots/pad", 10),
        ("runs/1-pass", 13),
    )
    print(f"{'workload':<40}" + "".join(f"{title:>{width}}" for title, width in header))
    workloads = [
        ("uniform", texts, args.samples, args.tokens, True, 0),
        ("long-tailed", texts, args.samples, args.tail_tokens, False, 0),
        ("refilled tail", prompts(args.tail_prompts), args.samples, args.tail_tokens, False, args.tail_rows),
        ("rollout", prompts(args.rollout_prompts), 4, 8, False, 1024),
    ]
    for name, batch, samples, tokens, uniform, rows in workloads:
        shape = (model, tokenizer, batch, samples, tokens, uniform)
        runs = {kv: functools.partial(run_embedded, *shape, kv, rows) for kv in ("padded", "slots")}
        runs["1-pass"] = functools.partial(run_embedded, *shape, "slots", rows, runs=False)
        if rows == 0:  # generate runs one static batch; the refilled workloads are larger than any batch
            runs["generate"] = functools.partial(run_generate, *shape)
        got = measure(runs, args.repeats)
        (pad, emb_tokens), (slots, _), (one_pass, _) = got["padded"], got["slots"], got["1-pass"]
        label = f"{name} (<= {tokens} tokens, mean {emb_tokens / (len(batch) * samples):.1f})"
        generate, versus = f"{'-':>15}", f"{'-':>9}"
        if "generate" in got:
            hf = got["generate"][0]
            generate, versus = f"{hf:>15,.0f}", f"{slots / hf:>8.2f}x"
        print(
            f"{label:<40}{generate}{pad:>14,.0f}{slots:>13,.0f}{one_pass:>14,.0f}{versus}{slots / pad:>9.2f}x"
            f"{slots / one_pass:>12.2f}x"
        )
    decode_efficiency(device, args.efficiency_rows, args.efficiency_tokens, args.repeats)


if __name__ == "__main__":
    main()
