"""A training or held-out prompt: the unit every task, recipe and stage passes around, and how it becomes
the token ids an engine is fed.

A prompt is plain text (fed as it is, with the tokenizer's own special tokens) or chat turns, rendered by
the base tokenizer's own chat template with the generation prompt, so an instruct model sees the format it
was tuned on. ``encode_prompt`` is the one place either happens: rollout, evaluation and the preflight
check all call it, so the text and ids a row stores are exactly what the engine saw. ``prompt_encodings``
keeps a tokenizer's encodings across rounds: a campaign draws from the same prompts round after round.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
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


ENCODINGS_MAX_TOKENS = 4_000_000
"""Token ids one tokenizer's cached encodings hold at most (about 150 MB of Python ints where every id is large);
past it the least recently used prompts are dropped first."""


class PromptEncodings:
    """``encode_prompt`` by one tokenizer, remembered: the same prompt gives the same (text, ids), so each distinct
    prompt is tokenized once for as long as the tokenizer lives. The tokenizer's per-call overhead costs more
    than the engine's prefill of a short prompt: at the built-in size, about a tenth of a rollout stage."""

    def __init__(self, tokenizer: Any, max_tokens: int = ENCODINGS_MAX_TOKENS) -> None:
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self._cache: OrderedDict[tuple, tuple[str, tuple[int, ...]]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()  # rollout and evaluation may encode at once (overlap mode)

    def __call__(self, prompt: Prompt) -> tuple[str, tuple[int, ...]]:
        key = (prompt.text, prompt.messages)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        encoded = encode_prompt(self.tokenizer, prompt)  # outside the lock; a race encodes twice, equally
        with self._lock:
            if key not in self._cache:
                self._cache[key] = encoded
                self._tokens += len(encoded[1])
            while self._tokens > self.max_tokens and len(self._cache) > 1:
                _, (_, ids) = self._cache.popitem(last=False)
                self._tokens -= len(ids)
        return encoded

    def __len__(self) -> int:
        return len(self._cache)


_ENCODINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ENCODINGS_LOCK = threading.Lock()


def prompt_encodings(tokenizer: Any) -> PromptEncodings:
    """This process's remembered encodings by ``tokenizer`` (the live engine's, reused round after round); they go
    with the tokenizer object."""
    with _ENCODINGS_LOCK:
        try:
            encodings = _ENCODINGS.get(tokenizer)
            if encodings is None:
                encodings = _ENCODINGS[tokenizer] = PromptEncodings(tokenizer)
        except TypeError:  # a tokenizer that cannot be weakly referenced or hashed: remembered by the caller alone
            encodings = PromptEncodings(tokenizer)
        return encodings
