"""Input checks before a campaign writes anything: each problem a user can fix, as one line naming
the input and the fix, raised before a run directory, an MLflow run or a model version exists.

Checked, cheapest first:
- the round's ``device``: one this machine has (``DeviceError``);
- prompt files (training and held-out): readable, well-formed, not empty (``PromptError``);
- the base policy: a complete Hugging Face directory (``PolicyLoadError``);
- every prompt fits the model's context with the tokens it may generate: prompt tokens plus
  ``rollout.max_tokens`` (training) or ``evaluate.max_tokens`` (held-out) within the model config's
  ``max_position_embeddings`` (``PromptError``); rollout checks each prompt again before generating it;
- MLflow answers (``LineageError``), last, since connecting creates an empty local SQLite store.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer

from models.builtin import BUILTIN_SOURCES, BUILTINS
from models.builtin.base_policy import build_model
from models.builtin.tokenizer import build_char_tokenizer
from models.checkpoint import check_policy_dir, context_length
from models.device import resolve_device
from models.prompt import encode_prompt
from storage import checkpoints
from storage.paths import StorageRoot
from storage.settings import settings
from storage.tracking import Tracker
from tasks.environments.types import load_environment
from tasks.prompts.sources import PromptError, evaluation_prompts, load_prompt_file
from tasks.round.results import Checked


def base_tokenizer_and_context(storage: str, base_model: str) -> tuple[Any, int | None]:
    """The tokenizer rollout will use and the model's context length, without building or loading weights.

    The built-in base may not be built yet: its tokenizer is fixed, and its context is read from the
    recipe's model config (a 0.6M-parameter model, built in milliseconds, never trained here)."""
    if base_model not in BUILTINS:
        check_policy_dir(base_model)
        return AutoTokenizer.from_pretrained(base_model), context_length(base_model)

    builtin = BUILTINS[base_model]
    tokenizer = build_char_tokenizer(builtin.characters)
    root = StorageRoot.of(storage)
    built = root.base_policy(builtin.cache_name)
    if root.is_local and checkpoints.is_committed(root, built):
        return tokenizer, context_length(built)
    return tokenizer, build_model(builtin.recipe, len(tokenizer), tokenizer).config.max_position_embeddings


def longest_prompt(prompts, tokenizer) -> tuple[Any, int]:
    """(prompt, its length in tokens) of the longest prompt, as rollout tokenizes it."""
    lengths = [len(encode_prompt(tokenizer, p)[1]) for p in prompts]
    index = max(range(len(prompts)), key=lambda i: lengths[i])
    return prompts[index], lengths[index]


def check_fits(prompts, tokenizer, max_context: int | None, new_tokens: int, source: str, setting: str) -> int:
    """Longest prompt's tokens; raises when it cannot fit in the context with ``new_tokens`` more."""
    prompt, tokens = longest_prompt(prompts, tokenizer)
    if max_context is not None and tokens + new_tokens > max_context:
        raise PromptError(
            f"prompt {prompt.prompt_id} of {source} is {tokens} tokens; with {setting}={new_tokens} it needs "
            f"{tokens + new_tokens} positions but the model has {max_context}; shorten or drop the prompt, "
            f"lower {setting}, or use a model with a longer context"
        )
    return tokens


def run_preflight(*, config: Any, storage: str) -> Checked:
    """Check a round config's inputs against the storage root; returns what was checked (for the log).

    ``config`` is a ``flows.config.RoundConfig`` (composed there from the stages' configs)."""
    resolve_device(config.device)
    if config.environment is not None:
        load_environment(config.environment)  # an environment that cannot load fails here, before the base is built
    if config.prompts.source in BUILTIN_SOURCES:  # a built-in stream is endless: check its longest prompt
        training = [BUILTIN_SOURCES[config.prompts.source].data.longest_prompt()]
    else:
        training = load_prompt_file(config.prompts.source, config.prompts.task, config.prompts)
    held_out = evaluation_prompts(config.prompts, config.evaluate.source)
    tokenizer, max_context = base_tokenizer_and_context(storage, config.policy.base_model)
    longest = check_fits(
        training, tokenizer, max_context, config.rollout.max_tokens, config.prompts.source, "rollout.max_tokens"
    )
    check_fits(
        held_out,
        tokenizer,
        max_context,
        config.evaluate.max_tokens,
        config.evaluate.source or config.prompts.source,
        "evaluate.max_tokens",
    )
    Tracker.connect(settings(), StorageRoot.of(storage))
    return Checked(
        stats={
            "preflight/training_prompts": len(training),
            "preflight/held_out_prompts": len(held_out),
            "preflight/longest_prompt_tokens": longest,
            "preflight/context": max_context or 0,
        }
    )
