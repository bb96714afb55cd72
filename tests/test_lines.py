"""Promotion lines: which checkpoints a champion gate compares. One line per task and held-out set, and by
default one registered model (so one champion) per line."""

import pytest
from pydantic import ValidationError

from flows.config import CampaignConfig, RoundConfig, load_campaign_config
from tasks.config.publish import PublishConfig, promotion_line
from tasks.evaluate.gate import other_line


@pytest.mark.parametrize(
    "task, held_out, line",
    [
        # the built-in held-out set: the task names it
        ("addition", None, "addition"),
        ("longtail", None, "longtail"),
        # a held-out file: its stem and a hash of its URI, so two files named alike are two lines
        ("addition", "/data/heldout.jsonl", "addition-heldout-" + "{h}"),
        ("addition", "s3://b/evals/heldout.jsonl", "addition-heldout-" + "{h}"),
        # characters a registered model name should not carry are replaced
        ("my task/v2", None, "my-task-v2"),
        ("math", "/x/grade school 'set'.parquet", "math-grade-school-set-" + "{h}"),
        # nothing usable left: a placeholder, never an empty name
        ("///", None, "task"),
    ],
)
def test_promotion_line(task, held_out, line):
    import hashlib

    expected = line.replace("{h}", hashlib.sha256(held_out.encode()).hexdigest()[:8]) if held_out else line
    assert promotion_line(task, held_out) == expected
    assert PublishConfig(line=expected).line == expected  # every derived line is a valid explicit one


def test_two_held_out_files_with_one_name_are_two_lines():
    assert promotion_line("addition", "/a/heldout.jsonl") != promotion_line("addition", "/b/heldout.jsonl")


def test_the_default_registered_model_is_per_line():
    addition = RoundConfig().publish_resolved
    longtail = load_campaign_config(None, "long-tail").round.publish_resolved
    held_out = RoundConfig.model_validate({"evaluate": {"source": "/data/heldout.jsonl"}}).publish_resolved
    assert (addition.line, addition.model_name) == ("addition", "rlrounds-addition")
    assert (longtail.line, longtail.model_name) == ("longtail", "rlrounds-longtail")
    assert held_out.model_name == f"rlrounds-{held_out.line}" and held_out.line.startswith("addition-heldout-")
    assert len({addition.model_name, longtail.model_name, held_out.model_name}) == 3


def test_an_explicit_name_or_line_is_kept():
    rc = RoundConfig.model_validate({"publish": {"model_name": "mine", "line": "sums"}})
    assert (rc.publish_resolved.model_name, rc.publish_resolved.line) == ("mine", "sums")
    named = RoundConfig.model_validate({"publish": {"line": "sums"}}).publish_resolved
    assert named.model_name == "rlrounds-sums"
    assert RoundConfig().publish.model_name is None  # the stored config keeps the default unresolved


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("line", "", "publish.line '' must be 1-100 letters"),
        ("line", "a/b", "must be 1-100 letters"),
        ("line", "-x", "starting with a letter or digit"),
        ("model_name", "a/b", "without '/' or quotes"),
        ("model_name", "", "must be non-empty"),
    ],
)
def test_bad_names_say_what_to_set(field, value, message):
    with pytest.raises(ValidationError, match=message):
        CampaignConfig.model_validate({"round": {"publish": {field: value}}})


def test_an_unresolved_publish_section_is_refused_where_it_registers():
    with pytest.raises(ValueError, match="publish_resolved"):
        _ = PublishConfig().registered_name


@pytest.mark.parametrize(
    "champion, candidate, other",
    [
        ({"line": "addition"}, {"line": "addition"}, None),  # one line: compared
        ({"line": "addition"}, {"line": "longtail"}, "addition"),  # two lines: refused
        ({}, {"line": "addition"}, None),  # a champion registered before lines: nothing to tell
        ({"line": "addition"}, {}, None),  # a candidate without a line (older code): nothing to tell
    ],
)
def test_other_line(champion, candidate, other):
    assert other_line(champion, candidate) == other
