"""Rounds started from a model the user knows (the `round` deployment's flow), in process: from the base,
then a two-round campaign from NAME/VERSION whose rounds chain on from that version."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

ROUND = {"train": {"groups_per_step": 2, "steps_per_round": 2}, "publish": {"model_name": "start-policy"}}


def test_a_campaign_from_a_registered_version_chains_its_rounds(prefect_harness, seed_builtin_base, tmp_path):
    from flows.config import RoundConfig
    from flows.start import rl_round_from
    from storage.paths import StorageRoot
    from storage.settings import settings
    from storage.tracking import Tracker

    storage = str(tmp_path / "data")
    seed_builtin_base(storage)
    config = RoundConfig.model_validate(ROUND)
    first = rl_round_from(start="base", config=config, run_id="from-base", storage=storage)
    assert [r["round"] for r in first["rounds"]] == [0, 1] and first["final_model_version"] == "start-policy/2"

    out = rl_round_from(start="start-policy/2", config=config, run_id="from-v2", storage=storage, rounds=2)
    assert out["start"] == "start-policy/2"
    assert [r["round"] for r in out["rounds"]] == [2, 3]  # numbered on from the starting version's round
    tracker = Tracker.connect(settings(), StorageRoot.of(storage))
    versions = [r["model_version"].split("/")[1] for r in out["rounds"]]
    tags = [tracker.model_version("start-policy", v).tags for v in versions]
    assert tags[0]["parent_model_version"] == "start-policy/2" and tags[0]["run_id"] == "from-v2"
    assert tags[1]["parent_model_version"] == out["rounds"][0]["model_version"]
    assert out["final_model_version"] == out["rounds"][1]["model_version"]
