"""Prompt sources: the built-in stream and prompt files."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from models.builtin import addition
from tasks.config.prompts import PromptsConfig
from tasks.prompts.sources import PromptError, evaluation_prompts, load_prompt_file, prompt_stream


def test_builtin_stream_is_seeded_and_never_touches_the_held_out_set():
    a = [p.prompt_id for _, p in zip(range(2000), prompt_stream(PromptsConfig(), seed=5))]
    b = [p.prompt_id for _, p in zip(range(2000), prompt_stream(PromptsConfig(), seed=5))]
    assert a == b
    held = {p.prompt_id for p in addition.held_out_prompts()}
    assert len(held) == 500 and not held & set(a)
    assert evaluation_prompts(PromptsConfig(), None)[0].prompt_id in held


def test_jsonl_and_parquet_files(tmp_path):
    records = [{"prompt": f"{i}+1=", "reference": str(i + 1)} for i in range(5)]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet)
    for path in (jsonl, parquet):
        prompts = load_prompt_file(str(path), "addition")
        assert [p.text for p in prompts] == [r["prompt"] for r in records]
        stream = prompt_stream(PromptsConfig(source=str(path)), seed=1)
        first_pass = {next(stream).text for _ in range(5)}
        assert first_pass == {r["prompt"] for r in records}  # a whole pass before any repeat


@pytest.mark.parametrize(
    "content, fragment",
    [
        ('{"prompt": "1+1="\n', "not valid JSON"),  # truncated line: names the line
        ('{"prompt": "1+1="}\n', "has no 'reference'"),  # missing reference: names the setting
        ("\n\n", "holds no prompts"),  # empty file
    ],
)
def test_bad_prompt_files(tmp_path, content, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(PromptError, match=fragment):
        load_prompt_file(str(path), "addition")


def test_missing_file_and_wrong_format():
    with pytest.raises(PromptError, match="does not exist"):
        load_prompt_file("/no/such/prompts.jsonl", "addition")
    with pytest.raises(ValueError, match="must be"):
        PromptsConfig(source="prompts.csv")
