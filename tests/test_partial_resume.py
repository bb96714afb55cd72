"""Partial rollouts keep what the rounds guarantee: a campaign killed after a round committed its
carry-over (and again while the next round resumed it) ends with the same rows and weights as an
uninterrupted one, and replaying a round whose rows span two policy versions reproduces its weights
bit for bit."""

from __future__ import annotations

import dataclasses
import os

import pytest

from storage.paths import StorageRoot
from tests.test_resume import TIMING_COLUMNS, Campaign, _same_tree, _tensors, weak_base  # noqa: F401 -- weak_base is a fixture

pytestmark = pytest.mark.slow

CONFIG = {
    "rounds": 2,
    "experiment": "partial",
    "round": {
        # 32 samples in flight (4 groups of 8): the batch fills while the last groups fed are still generating
        "rollout": {"samples_per_prompt": 8, "max_tokens": 12, "max_batch": 32, "partial_rollouts": True},
        "train": {"groups_per_step": 4, "steps_per_round": 2},
        "publish": {"model_name": "partial-policy"},
        "seed": 7,
    },
}
KILL_POINTS = ["filter:1", "rollout:2"]  # after round 1 committed its carry-over; after round 2 staged what resumed it


def _rounds(storage):
    """Per round: rows and carry-over without timing columns, and the trajectory manifest."""
    from storage.trajectories import committed_round_version, read_carryover, read_table

    root = StorageRoot.of(storage)
    out = {}
    for k in (1, 2):
        manifest = committed_round_version(root, "partial", k)
        strip = lambda rows: [{c: v for c, v in r.items() if c not in TIMING_COLUMNS} for r in rows]  # noqa: E731
        carryover = [dataclasses.asdict(r) for r in read_carryover(root, manifest)]
        out[k] = (strip(read_table(root, manifest).to_pylist()), strip(carryover), manifest)
    return out


@pytest.fixture(scope="module")
def campaigns(prefect_harness, weak_base, tmp_path_factory):  # noqa: F811 -- the fixture imported above
    import yaml

    home = tmp_path_factory.mktemp("partial")
    config_path = home / "campaign.yaml"
    config_path.write_text(
        yaml.safe_dump({**CONFIG, "round": {**CONFIG["round"], "policy": {"base_model": weak_base}}})
    )
    reference, crashed = Campaign(str(home / "reference")), Campaign(str(home / "crashed"))
    reference.run("--config", str(config_path), "--run-id", "partial")
    crashed.run("--config", str(config_path), "--run-id", "partial", crash_after=KILL_POINTS[0], expect_crash=True)
    for point in KILL_POINTS[1:]:
        crashed.run("--resume", "partial", crash_after=point, expect_crash=True)
    out, _ = crashed.run("--resume", "partial")
    assert "round 2:" in out
    return reference.storage, crashed.storage


def test_a_round_killed_after_its_carry_over_was_committed_resumes_to_the_same_rows_and_weights(campaigns):
    reference, crashed = campaigns
    ref, got = _rounds(reference), _rounds(crashed)
    rows1, carry1, _ = ref[1]
    # round 1 did stop stragglers
    assert any(r["carry_state"] == "partial" and r["completion_token_ids"] for r in carry1)
    spanning = [r for r in ref[2][0] if set(r["token_policy_versions"]) == {0, 1}]
    assert spanning and all(r["group_id"].startswith("r1-") and r["round"] == 2 for r in spanning)
    carried = {(r["group_id"], r["sample_index"]) for r in carry1}
    assert carried.isdisjoint((r["group_id"], r["sample_index"]) for r in rows1)
    # finished in round 2, or carried on
    assert carried <= {(r["group_id"], r["sample_index"]) for r in ref[2][0] + ref[2][1]}
    for k in (1, 2):
        assert got[k][0] == ref[k][0] and got[k][1] == ref[k][1]  # the same rows and carry-over, none twice
        assert len(os.listdir(StorageRoot.of(crashed).round_trajectories("partial", k))) == 1
        ref_ckpt, ckpt = (StorageRoot.of(s).checkpoint("partial", k) for s in (reference, crashed))
        assert _same_tree(_tensors(ckpt), _tensors(ref_ckpt)), f"round {k} checkpoint differs"


def test_replaying_a_round_whose_rows_span_two_policy_versions_reproduces_its_weights_bitwise(campaigns):
    from flows.config import CampaignConfig, ReplayRequest
    from flows.replay import rl_replay

    reference, _ = campaigns
    rows, _, manifest = _rounds(reference)[2]
    kept = [r for r in rows if r["kept"]]
    assert any(len(set(r["token_policy_versions"])) > 1 for r in kept)  # training did see tokens of two versions
    round_config = CampaignConfig.model_validate(CONFIG).round
    request = ReplayRequest(
        trajectories=manifest.version, from_model="partial-policy/2", config=round_config, evaluate=False
    )
    result = rl_replay(request, storage=reference)
    original = os.path.join(StorageRoot.of(reference).checkpoint("partial", 2), "model.safetensors")
    replayed = os.path.join(result["checkpoint"], "model.safetensors")
    assert open(replayed, "rb").read() == open(original, "rb").read()
