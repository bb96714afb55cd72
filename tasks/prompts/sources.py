"""Prompt sources: a built-in task (addition, longtail), or a Parquet / JSONL file with a prompt column and a
reference column (``prompts.prompt_column``, ``prompts.reference_column``; a dotted path reaches a nested field).

A file's prompt is a string or chat turns (a list of ``{role, content}``). Chat turns, and strings under
``prompts.chat_template``, become a ``Prompt`` with ``messages`` (the system prompt first, if set): the base
tokenizer's chat template renders them where they are tokenized (``models.prompt.encode_prompt``).

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
from models.prompt import Prompt, Turn
from storage.settings import filesystem_for
from storage.trajectories import PARQUET_READ_THREADS
from tasks.config.prompts import PromptsConfig


class PromptError(ValueError):
    pass


MESSAGES = "messages"
"""The prompt column of a file without a 'prompt' column, as chat datasets name it."""


def load_prompt_file(uri: str, task: str, config: PromptsConfig | None = None) -> list[Prompt]:
    """Read every prompt of a file, failing with one line that names the file and the fix. ``config``: which
    columns hold the prompt and the reference, and how chat is rendered (default: 'prompt', 'reference', plain)."""
    config = config or PromptsConfig()
    records = _read_records(uri)
    if not records:
        raise PromptError(f"prompt file {uri} holds no prompts; add at least one record with prompt and reference")
    prompt_column = config.prompt_column
    if prompt_column == "prompt" and isinstance(records[0], dict) and "prompt" not in records[0]:
        prompt_column = MESSAGES if MESSAGES in records[0] else prompt_column
    prompts = []
    for i, rec in enumerate(records):
        where = f"{uri}: record {i + 1}"
        if not isinstance(rec, dict):
            raise PromptError(f"{where} is not an object; every record needs {prompt_column} and reference")
        value = _column(rec, prompt_column, "prompt_column", where)
        reference = _column(rec, config.reference_column, "reference_column", where)
        if reference is None:
            raise PromptError(f"{where} has no reference in {config.reference_column!r}; every record needs one")
        if isinstance(value, str):
            if not value.strip():
                raise PromptError(f"{where} has an empty prompt; remove it or give it text")
            key, turns = value, ((("user", value),) if config.chat_template else None)
        else:
            turns = _turns(value, where, prompt_column)
            key = json.dumps(turns)
        if turns is not None and config.system_prompt is not None and turns[0][0] != "system":
            turns = (("system", config.system_prompt), *turns)
        digest = hashlib.sha256(f"{key}\x00{reference}".encode()).hexdigest()[:12]
        text = turns[-1][1] if turns else value
        prompts.append(Prompt(str(rec.get("id", f"p-{digest}")), task, text, str(reference), turns))
    return prompts


def _read_records(uri: str) -> list:
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
            return records
        with fs.open(uri, "rb") as f:
            return pq.read_table(f, use_threads=PARQUET_READ_THREADS).to_pylist()
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


def _column(record: dict, path: str, setting: str, where: str):
    """The value at a dotted ``path`` of ``record``; a missing one names the columns there and the setting."""
    value: object = record
    for depth, part in enumerate(path.split(".")):
        if not isinstance(value, dict) or part not in value:
            at = ".".join(path.split(".")[:depth]) or "the record"
            columns = ", ".join(map(repr, value)) if isinstance(value, dict) else f"a {type(value).__name__}"
            raise PromptError(
                f"{where} has no {path!r} ({at} holds {columns}); set prompts.{setting} to the column that holds it"
            )
        value = value[part]
    return value


def _turns(value, where: str, column: str) -> tuple[Turn, ...]:
    """Chat turns from a list of {role, content} objects, or one line saying what is wrong."""
    if not isinstance(value, list) or not value:
        raise PromptError(
            f"{where}: {column!r} is neither a string nor a non-empty list of chat turns ({{role, content}} objects)"
        )
    turns = []
    for turn in value:
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            raise PromptError(f"{where}: {column!r} holds a turn that is not a {{role, content}} object of strings")
        turns.append((turn["role"], turn["content"]))
    return tuple(turns)


def prompt_stream(config: PromptsConfig, seed: int) -> Iterator[Prompt]:
    """Endless prompts: a built-in task's seeded stream, or seeded reshuffled passes over a file."""
    if config.source in BUILTIN_SOURCES:
        yield from BUILTIN_SOURCES[config.source].data.prompt_stream(seed)
        return
    rng = random.Random(seed)
    prompts = load_prompt_file(config.source, config.task, config)
    while True:
        order = list(range(len(prompts)))
        rng.shuffle(order)
        for i in order:
            yield prompts[i]


def evaluation_prompts(config: PromptsConfig, eval_source: str | None) -> list[Prompt]:
    if eval_source:
        return load_prompt_file(eval_source, config.task, config)
    if config.source in BUILTIN_SOURCES:
        return BUILTIN_SOURCES[config.source].data.held_out_prompts()
    raise PromptError("evaluation needs held-out prompts: set evaluate.source to a .jsonl or .parquet file")
