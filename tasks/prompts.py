"""Prompt sources: a built-in task (addition, longtail), or a Parquet / JSONL file with ``prompt`` and
``reference``.

A source yields an endless, seeded stream of prompts: rollout draws from it until the trainable
batch is full, so a round never needs to know in advance how many prompts it will use.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator

import pyarrow.parquet as pq

from models.builtin import BUILTIN_SOURCES
from models.prompt import Prompt
from storage.settings import filesystem_for
from tasks.config.prompts import PromptsConfig


class PromptError(ValueError):
    pass


def load_prompt_file(uri: str, task: str) -> list[Prompt]:
    """Read every prompt of a file, failing with one line that names the file and the fix."""
    fs = filesystem_for(uri)
    try:
        if uri.endswith(".jsonl"):
            records = []
            with fs.open(uri, "r") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            records.append(json.loads(line))
                        except json.JSONDecodeError as exc:
                            raise PromptError(
                                f"{uri}:{lineno}: not valid JSON ({exc.msg}); each line must be an object with "
                                "prompt and reference"
                            ) from None
        else:
            with fs.open(uri, "rb") as f:
                records = pq.read_table(f).to_pylist()
    except FileNotFoundError:
        raise PromptError(
            f"prompt file {uri} does not exist; set prompts.source to an existing .jsonl or .parquet file"
        ) from None
    except PromptError:
        raise
    except Exception as exc:  # noqa: BLE001 -- not UTF-8, not Parquet, a directory, no permission: the file's problem
        kind = "UTF-8 JSON lines" if uri.endswith(".jsonl") else "a Parquet file"
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise PromptError(
            f"prompt file {uri} cannot be read as {kind} ({reason}); rewrite it with columns prompt and reference"
        ) from None
    prompts = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or rec.get("reference") is None:
            raise PromptError(
                f"{uri}: record {i + 1} lacks a string 'prompt' and a 'reference'; every record needs both"
            )
        text = rec["prompt"]
        if not text.strip():
            raise PromptError(f"{uri}: record {i + 1} has an empty prompt; remove it or give it text")
        digest = hashlib.sha256(f"{text}\x00{rec['reference']}".encode()).hexdigest()[:12]
        prompts.append(
            Prompt(prompt_id=str(rec.get("id", f"p-{digest}")), task=task, text=text, reference=str(rec["reference"]))
        )
    if not prompts:
        raise PromptError(f"prompt file {uri} holds no prompts; add at least one record with prompt and reference")
    return prompts


def prompt_stream(config: PromptsConfig, seed: int) -> Iterator[Prompt]:
    """Endless prompts: a built-in task's seeded stream, or seeded reshuffled passes over a file."""
    if config.source in BUILTIN_SOURCES:
        yield from BUILTIN_SOURCES[config.source].data.prompt_stream(seed)
        return
    rng = random.Random(seed)
    prompts = load_prompt_file(config.source, config.task)
    while True:
        order = list(range(len(prompts)))
        rng.shuffle(order)
        for i in order:
            yield prompts[i]


def evaluation_prompts(config: PromptsConfig, eval_source: str | None) -> list[Prompt]:
    if eval_source:
        return load_prompt_file(eval_source, config.task)
    if config.source in BUILTIN_SOURCES:
        return BUILTIN_SOURCES[config.source].data.held_out_prompts()
    raise PromptError("evaluation needs held-out prompts: set evaluate.source to a .jsonl or .parquet file")
