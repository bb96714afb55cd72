"""A training or held-out prompt: the unit every task, recipe and stage passes around, and how it becomes
the token ids an engine is fed.

A prompt is plain text (fed as it is, with the tokenizer's own special tokens) or chat turns, rendered by
the base tokenizer's own chat template with the generation prompt, so an instruct model sees the format it
was tuned on. ``encode_prompt`` is the one place either happens: rollout, evaluation and the preflight
check all call it, so the text and ids a row stores are exactly what the engine saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Turn = tuple[str, str]
"""One chat turn: (role, content)."""


class ChatTemplateError(ValueError):
    pass


@dataclass(frozen=True)
class Prompt:
    """One prompt: its stable id, the task it belongs to, the text fed to the policy and the reference
    answer (or tests) a verifier scores a completion against.

    ``messages``: chat turns to render through the tokenizer's chat template instead of ``text`` (which
    then holds the last turn's content until it is rendered); None for a plain-text prompt."""

    prompt_id: str
    task: str
    text: str
    reference: str
    messages: tuple[Turn, ...] | None = None


def encode_prompt(tokenizer: Any, prompt: Prompt) -> tuple[str, tuple[int, ...]]:
    """(the text the engine is fed, its token ids). Plain text is tokenized with the tokenizer's special tokens
    (a BOS where it adds one); chat turns are rendered by the tokenizer's chat template with the generation
    prompt and tokenized as rendered (the template writes its own special tokens), so the ids decode to the text."""
    if prompt.messages is None:
        return prompt.text, tuple(tokenizer(prompt.text)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"prompt {prompt.prompt_id} is chat turns but the base model's tokenizer has no chat template; give its "
            "tokenizer_config.json a 'chat_template', or use plain string prompts with prompts.chat_template false"
        )
    turns = [{"role": role, "content": content} for role, content in prompt.messages]
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return text, tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
