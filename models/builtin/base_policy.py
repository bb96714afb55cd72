"""The built-in base policies: tiny Llamas trained from scratch on a built-in task, stopped early on purpose.

A deterministic recipe (fixed seeds, fixed thread count, fixed data order) so that every machine of one
kind builds the same starting point, and RL has headroom: the recipe stops at roughly 40% greedy held-out
accuracy. Which task and recipe: ``models.builtin``. ``python -m models.builtin.base_policy OUT_DIR [BASE]``
builds one by hand (BASE: 'builtin', the default, 'builtin-longtail' or 'builtin-tooladd').

A base trains on the device it is given (a campaign's ``device``) and is saved from CPU tensors. Built on the
CPU it is the same bit for bit on every CPU with the same vector extensions (torch's AVX2 and AVX-512 kernels
round differently and build different bases); built on a GPU it is a different (equally good) starting point.
Its lineage.json says where it was trained (``trained_on``: the device and, on a CPU, torch's kernel level).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from models.builtin import BUILTINS, BuiltinTask
from models.builtin.recipe import (
    RECIPE_VERSION as RECIPE_VERSION,  # re-exported: the addition base's cache name uses it
)
from models.builtin.recipe import BaseRecipe
from models.builtin.tokenizer import build_char_tokenizer
from models.checkpoint import save_policy, set_threads
from models.engines.embedded import EmbeddedEngine
from models.engines.greedy import greedy_completions
from models.engines.types import RolloutEngine
from models.logprobs import TokenBatch, pack_sequences
from models.prompt import Prompt

EnvironmentSpans = Callable[[str], list[tuple[int, int]]]
"""A reference's character spans that the environment writes (``BuiltinTask.environment_spans``)."""


def build_model(recipe: BaseRecipe, vocab_size: int, tokenizer):
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def build_base_policy(
    out_dir: str,
    recipe: BaseRecipe | None = None,
    progress=None,
    task: BuiltinTask | None = None,
    device: torch.device | str = "cpu",
) -> dict:
    """Train the base policy of ``task`` (default: addition) into ``out_dir`` (local) on ``device``, with its
    own recipe unless ``recipe`` is given. Returns its metadata (with held-out accuracy)."""
    task = task or BUILTINS["builtin"]
    recipe = recipe or task.recipe
    start = time.perf_counter()
    previous_threads = set_threads(recipe.threads)  # a campaign built after another count pays for it
    try:
        return _build(out_dir, recipe, progress, start, task, torch.device(device))
    finally:
        set_threads(previous_threads)


def cpu_kernels(device: torch.device) -> dict[str, str]:
    """On a CPU, the vector kernels torch runs there ('AVX2', 'AVX512', ...): two CPUs of one level build the same
    base bit for bit, two of different levels another. Nothing on a GPU."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability()} if device.type == "cpu" else {}


def _build(out_dir: str, recipe: BaseRecipe, progress, start: float, task: BuiltinTask, device: torch.device) -> dict:
    torch.manual_seed(recipe.seed)
    tokenizer = build_char_tokenizer(task.characters)
    model = build_model(recipe, len(tokenizer), tokenizer).to(device)  # initialised on the CPU: the same everywhere
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate)
    # Drawn as the steps take them: a recipe that stops early (most do) never draws the rest.
    prompts = task.data.base_prompt_stream(seed=recipe.seed)
    # Stopping is judged on training prompts (another seed), so the held-out set stays untouched.
    validation = task.data.base_validation_prompts(seed=recipe.seed + 1, count=500)
    spans = task.environment_spans
    engine = EmbeddedEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    steps, val_accuracy = 0, 0.0
    for step in range(recipe.max_steps):
        model.train()
        chunk = list(itertools.islice(prompts, recipe.batch_size))
        batches = [_answer_batch(tokenizer, part, device, spans) for part in _by_length(chunk, recipe.length_buckets)]
        answer_tokens = sum(b.completion_mask.sum() for b in batches)
        optimizer.zero_grad(set_to_none=True)
        loss_value = 0.0
        for batch in batches:
            logits = _logits(model, batch)
            # Supervised loss on the answer tokens only: the prompt is given, never predicted. Each
            # bucket's tokens weigh as they would in one pass over the whole batch.
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].transpose(1, 2), batch.input_ids[:, 1:], reduction="none"
            )
            loss = (nll * batch.completion_mask.float()).sum() / answer_tokens
            loss.backward()
            loss_value += loss.item()
        optimizer.step()
        steps = step + 1
        if steps % recipe.check_every == 0:
            model.eval()
            if recipe.teacher_forced_checks:
                val_accuracy = teacher_forced_accuracy(model, tokenizer, validation, recipe.length_buckets, spans)
            else:
                val_accuracy = greedy_accuracy(engine, tokenizer, validation, task.answer_tokens)
            if progress:
                progress(
                    f"base policy: step {steps}/{recipe.max_steps} loss {loss_value:.3f} "
                    f"validation accuracy {val_accuracy:.1%}"
                )
            if val_accuracy >= recipe.stop_at_accuracy:
                break
    model.eval()
    accuracy = greedy_accuracy(engine, tokenizer, task.data.held_out_prompts(), task.answer_tokens)
    save_policy(model, tokenizer, out_dir)
    meta = {
        "name": task.policy_name,
        "recipe_version": task.recipe_version,
        "recipe": asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        "trained_on": {"device": device.type, **cpu_kernels(device)},
        "steps": steps,
        "validation_accuracy": val_accuracy,
        "held_out_accuracy": accuracy,
        "build_seconds": round(time.perf_counter() - start, 1),
    }
    with open(os.path.join(out_dir, "lineage.json"), "w") as f:
        json.dump({"kind": "base", **meta}, f, indent=2)
    return meta


def _by_length(prompts: list, buckets: int) -> list[list]:
    """``buckets`` runs of prompts of similar answer length (one run, in order, when ``buckets`` is 1)."""
    if buckets == 1:
        return [prompts]
    ordered = sorted(prompts, key=lambda p: len(p.reference))
    size = -(-len(ordered) // buckets)
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def _answer_batch(tokenizer, prompts, device: torch.device, spans: EnvironmentSpans | None = None) -> TokenBatch:
    """Prompts followed by their reference answers and end-of-sequence, packed on ``device``. With ``spans``, the
    tokens of each reference inside them (the environment's, in an episode) are left out of ``completion_mask``."""
    enc_prompts = [tokenizer(p.text)["input_ids"] for p in prompts]
    enc_answers = [
        tokenizer(p.reference, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for p in prompts
    ]
    packed = pack_sequences(enc_prompts, enc_answers, tokenizer.pad_token_id)
    if spans is not None:
        width = max(len(e) for e in enc_prompts)  # where every answer starts
        for row, prompt in enumerate(prompts):
            offsets = tokenizer(prompt.reference, add_special_tokens=False, return_offsets_mapping=True)
            for i, (start, end) in enumerate(offsets["offset_mapping"]):
                if any(start < stop and begin < end for begin, stop in spans(prompt.reference)):
                    packed.completion_mask[row, width + i - 1] = 0  # the mask's column t is target token t + 1
    return TokenBatch(*(getattr(packed, f.name).to(device) for f in fields(packed)))


def _logits(model, batch):
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    return model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions
    ).logits  # [B, T, V]


def teacher_forced_accuracy(
    model, tokenizer, prompts, buckets: int = 1, spans: EnvironmentSpans | None = None
) -> float:
    """Greedy exact-match accuracy without decoding: greedy decoding writes the reference and stops exactly
    when, fed the reference, the argmax at every answer position (end-of-sequence included) is the next
    reference token. One forward pass instead of up to ``answer_tokens`` decode steps, where wrong
    samples would run on to the limit. Tokens inside ``spans`` are the environment's and not judged."""
    correct = 0
    device = next(model.parameters()).device
    with torch.inference_mode():
        for part in _by_length(prompts, buckets):
            batch = _answer_batch(tokenizer, part, device, spans)
            hits = _logits(model, batch)[:, :-1].argmax(-1) == batch.input_ids[:, 1:]  # [B, T-1]
            correct += int((hits | ~batch.completion_mask.bool()).all(-1).sum())
    return correct / len(prompts)


def greedy_accuracy(
    engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt], max_tokens: int = 8
) -> float:
    """Greedy exact-match accuracy of ``engine`` on ``prompts`` (the built-in verifiers' rule)."""
    correct = sum(
        text.strip() == prompt.reference
        for prompt, text, _ in greedy_completions(engine, tokenizer, prompts, max_tokens)
    )
    return correct / len(prompts)


if __name__ == "__main__":
    from models.builtin import BUILTINS, BuiltinTask

    meta = build_base_policy(
        sys.argv[1], progress=print, task=BUILTINS[sys.argv[2] if len(sys.argv) > 2 else "builtin"]
    )
    print(json.dumps(meta, indent=2))
