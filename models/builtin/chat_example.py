"""The worked example of "your own model and data": a tiny Qwen2 with a byte-level BPE tokenizer and a chat
template, made here the way a user's instruct model arrives (a Hugging Face directory), and taught briefly to
answer chat-format math problems, so an RL campaign on it exercises every part of the real path: the chat
template, subword tokens, several end-of-sequence ids, a pad token that is not one of them.

``python -m models.builtin.chat_example OUT_DIR [PROMPTS.jsonl]`` builds one by hand. The build is
deterministic (fixed seeds, one thread count, fixed data order) and takes seconds on a CPU.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from models.checkpoint import save_policy, set_threads
from models.logprobs import pack_sequences
from models.prompt import Prompt, encode_prompt

EXAMPLE_VERSION = "1"  # bump when the recipe, tokenizer or template change: caches are named by it
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM_PROMPT = "Solve the problem. End with: The answer is N."
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GSM_MINI = os.path.join(REPO, "tasks", "prompts", "gsm_mini.jsonl")


def answer_text(reference: str) -> str:
    """The completion the recipe teaches (the math verifier reads its last number)."""
    return f"The answer is {reference}."


def build_chat_tokenizer(texts: Iterable[str], vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``texts`` (Qwen2's kind of tokenizer): end-of-text is the pad token,
    end-of-turn the end-of-sequence token, and the chat template writes Qwen's turn markers."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no text is out of vocabulary
        show_progress=False,
    )
    core.train_from_iterator(list(texts), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def chat_prompts(path: str = GSM_MINI) -> list[Prompt]:
    """The file's problems as chat turns (system prompt, then the problem as the user's turn)."""
    prompts = []
    with open(path) as f:
        for i, line in enumerate(x for x in f if x.strip()):
            rec = json.loads(line)
            turns = (("system", SYSTEM_PROMPT), ("user", rec["prompt"]))
            prompts.append(Prompt(f"chat-{i}", "math", rec["prompt"], str(rec["reference"]), turns))
    return prompts


def build_chat_policy(out_dir: str, prompts_path: str = GSM_MINI, steps: int = 60, seed: int = 0) -> dict:
    """Train the example policy into ``out_dir`` for ``steps`` full-batch steps of supervised answers on the
    problems of ``prompts_path``, rendered through its own chat template: enough that greedy answers are right
    sometimes (about one in five), not so many that RL has nothing left to do. Returns its metadata."""
    previous = set_threads(2)  # float reductions split by thread count: fixed, every machine builds the same
    try:
        torch.manual_seed(seed)
        prompts = chat_prompts(prompts_path)
        corpus = [p.text for p in prompts] + [answer_text(p.reference) for p in prompts] + [SYSTEM_PROMPT]
        tokenizer = build_chat_tokenizer(corpus)
        config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,  # head_dim 32: vLLM's CPU attention has no kernel for 16
            num_key_value_heads=1,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model = Qwen2ForCausalLM(config)
        # As instruct models ship: generation stops at end-of-turn or end-of-text.
        model.generation_config = GenerationConfig(
            eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id
        )
        encoded = [list(encode_prompt(tokenizer, p)[1]) for p in prompts]
        answers = [
            tokenizer(answer_text(p.reference), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            for p in prompts
        ]
        batch = pack_sequences(encoded, answers, tokenizer.pad_token_id)
        positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model.train()
        for _ in range(steps):
            logits = model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions
            ).logits  # [B, T, V]
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].transpose(1, 2), batch.input_ids[:, 1:], reduction="none"
            )
            loss = (nll * batch.completion_mask).sum() / batch.completion_mask.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        model.eval()
        save_policy(model, tokenizer, out_dir)
        meta = {"name": "chat-example-qwen2", "version": EXAMPLE_VERSION, "steps": steps, "loss": loss.item()}
        with open(os.path.join(out_dir, "lineage.json"), "w") as f:
            json.dump({"kind": "base", **meta}, f, indent=2)
        return meta
    finally:
        set_threads(previous)


if __name__ == "__main__":
    print(json.dumps(build_chat_policy(sys.argv[1], *sys.argv[2:3]), indent=2))


def random_chat_policy(texts: Iterable[str], *, seed: int = 0, layers: int = 2) -> tuple[Qwen2ForCausalLM, Any]:
    """The example's architecture and tokenizer (trained on ``texts``), at random weights and not saved: for tests and
    benchmarks that need a chat model's shape and format but no skill (engines, episodes)."""
    torch.manual_seed(seed)
    tokenizer = build_chat_tokenizer(texts)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen2ForCausalLM(config).eval(), tokenizer
