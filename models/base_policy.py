"""The built-in base policy: a tiny Llama trained from scratch on addition, stopped early on purpose.

A deterministic recipe (fixed seeds, fixed thread count, fixed data order) so that every machine
builds the same starting point, and RL has headroom: the recipe stops at roughly 40% greedy held-out
accuracy. ``python -m models.base_policy OUT_DIR`` builds one by hand.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass

from models import addition
from models.tokenizer import build_char_tokenizer

RECIPE_VERSION = "2"


@dataclass(frozen=True)
class BaseRecipe:
    hidden_size: int = 128
    num_layers: int = 3
    intermediate_size: int = 384
    num_heads: int = 4
    max_steps: int = 1500
    check_every: int = 25
    stop_at_accuracy: float = 0.35  # validation accuracy at which training stops (RL needs headroom)
    batch_size: int = 128
    learning_rate: float = 1e-3
    seed: int = 0
    threads: int = 2  # float reductions split by thread count: fixing it makes every machine build the same policy


def build_model(recipe: BaseRecipe, vocab_size: int, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def build_base_policy(out_dir: str, recipe: BaseRecipe = BaseRecipe(), progress=None) -> dict:
    """Train the base policy into ``out_dir`` (local). Returns its metadata (with held-out accuracy)."""
    import torch

    start = time.perf_counter()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        return _build(out_dir, recipe, progress, start)
    finally:
        torch.set_num_threads(previous_threads)


def _build(out_dir: str, recipe: BaseRecipe, progress, start: float) -> dict:
    import torch

    from models.engine import EmbeddedEngine
    from models.policy import pack_sequences, save_policy

    torch.manual_seed(recipe.seed)
    tokenizer = build_char_tokenizer()
    model = build_model(recipe, len(tokenizer), tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate)
    prompts = addition.training_prompts(seed=recipe.seed, count=recipe.max_steps * recipe.batch_size)
    # Stopping is judged on training pairs (another seed), so the held-out set stays untouched.
    validation = addition.training_prompts(seed=recipe.seed + 1, count=500)
    engine = EmbeddedEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    steps, val_accuracy = 0, 0.0
    for step in range(recipe.max_steps):
        model.train()
        chunk = prompts[step * recipe.batch_size : (step + 1) * recipe.batch_size]
        enc_prompts = [tokenizer(p.text)["input_ids"] for p in chunk]
        enc_answers = [
            tokenizer(p.reference, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for p in chunk
        ]
        batch = pack_sequences(enc_prompts, enc_answers, tokenizer.pad_token_id)
        positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions).logits
        # Supervised loss on the answer tokens only: the prompt is given, never predicted.
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), batch.input_ids[:, 1:], reduction="none"
        )
        mask = batch.completion_mask.float()
        loss = (nll * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        steps = step + 1
        if steps % recipe.check_every == 0:
            model.eval()
            val_accuracy = greedy_accuracy(engine, tokenizer, validation)
            if progress:
                progress(f"base policy: step {steps} loss {loss.item():.3f} validation accuracy {val_accuracy:.1%}")
            if val_accuracy >= recipe.stop_at_accuracy:
                break
    model.eval()
    accuracy = greedy_accuracy(engine, tokenizer, addition.held_out_prompts())
    save_policy(model, tokenizer, out_dir)
    meta = {
        "name": "builtin-addition-llama",
        "recipe_version": RECIPE_VERSION,
        "recipe": asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": steps,
        "validation_accuracy": val_accuracy,
        "held_out_accuracy": accuracy,
        "build_seconds": round(time.perf_counter() - start, 1),
    }
    with open(os.path.join(out_dir, "lineage.json"), "w") as f:
        json.dump({"kind": "base", **meta}, f, indent=2)
    return meta


def greedy_accuracy(engine, tokenizer, prompts) -> float:
    """Greedy exact-match accuracy of ``engine`` on ``prompts`` (the addition verifier's rule)."""
    from models.engine import greedy_completions

    correct = sum(
        text.strip() == prompt.reference for prompt, text, _ in greedy_completions(engine, tokenizer, prompts, 8)
    )
    return correct / len(prompts)


if __name__ == "__main__":
    meta = build_base_policy(sys.argv[1], progress=print)
    print(json.dumps(meta, indent=2))
