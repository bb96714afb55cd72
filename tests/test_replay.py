"""Replay: training on a stored trajectory version from a registered checkpoint reproduces the round
that made it, bit for bit on CPU, and publishes a model version whose tags record the replay."""

import json
import os

import pytest

from flows.cli import main
from flows.config import CampaignConfig
from storage.paths import StorageRoot
from storage.settings import settings
from storage.tracking import LINEAGE_TAGS

pytestmark = pytest.mark.slow


def _tracker(storage):
    from storage.tracking import Tracker

    return Tracker.connect(settings(), StorageRoot.of(storage))


@pytest.fixture(scope="module")
def replay(tiny_campaign) -> dict:
    """Round 2's own trajectories, replayed from round 1's model version with the campaign's config."""
    from flows.config import ReplayRequest
    from flows.replay import rl_replay

    rounds = tiny_campaign["result"]["rounds"]
    round_config = CampaignConfig.model_validate(tiny_campaign["config"]).round
    request = ReplayRequest(
        trajectories=rounds[2]["trajectory_version"], from_model=rounds[1]["model_version"], config=round_config
    )
    return rl_replay(request, storage=tiny_campaign["storage"])


def test_replaying_round_two_from_round_one_reproduces_its_weights_bitwise(tiny_campaign, replay):
    from safetensors.torch import load_file

    storage, rounds = tiny_campaign["storage"], tiny_campaign["result"]["rounds"]
    round_config = CampaignConfig.model_validate(tiny_campaign["config"]).round
    root = StorageRoot.of(storage)
    original, replayed = root.checkpoint("tiny", 2), replay["checkpoint"]
    assert replayed == root.replay_checkpoint(replay["replay_id"]) != original
    assert (
        open(os.path.join(replayed, "model.safetensors"), "rb").read()
        == open(os.path.join(original, "model.safetensors"), "rb").read()
    )
    a, b = (
        load_file(os.path.join(original, "model.safetensors")),
        load_file(os.path.join(replayed, "model.safetensors")),
    )
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a)
    assert any(
        not a[k].equal(load_file(os.path.join(root.checkpoint("tiny", 1), "model.safetensors"))[k]) for k in a
    )  # it did train

    name, version = replay["model_version"].split("/")
    tags = _tracker(storage).model_version(name, version).tags
    assert all(tags.get(t) for t in LINEAGE_TAGS)
    assert tags["kind"] == "replay" and tags["run_id"] == replay["replay_id"] and tags["round"] == "2"
    assert tags["parent_model_version"] == rounds[1]["model_version"]
    assert tags["trajectory_version"] == rounds[2]["trajectory_version"]
    assert tags["config_hash"] == round_config.config_hash()
    assert 0.0 <= float(tags["eval.accuracy"]) <= 1.0
    lineage = json.load(open(os.path.join(replayed, "lineage.json")))
    assert lineage["kind"] == "replay" and lineage["replay_of"] == {"run_id": "tiny", "round": 2}
    assert lineage["train_config"] == round_config.train.model_dump(mode="json")


def test_cli_replay_defaults_to_the_recorded_training_config_and_is_idempotent(tiny_campaign, replay, capsys):
    capsys.readouterr()
    rounds = tiny_campaign["result"]["rounds"]
    argv = [
        "replay",
        "--trajectories",
        rounds[2]["trajectory_version"][:10],
        "--from-model",
        rounds[1]["model_version"],
        "--storage",
        tiny_campaign["storage"],
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # same inputs (the round's recorded training config) -> same replay id, same checkpoint, same model version
    assert out.startswith(
        f"{replay['replay_id']}: {rounds[1]['model_version']} + trajectories {rounds[2]['trajectory_version']} "
        f"-> {replay['model_version']}"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--from-model", "tiny-policy"], "must be a registered model version NAME/VERSION"),
        (["--from-model", "tiny-policy/99"], "no registered model version tiny-policy/99"),
        (
            ["--from-model", "tiny-policy/2", "--config", "/nonexistent.yaml"],
            "config file /nonexistent.yaml does not exist",
        ),
    ],
)
def test_cli_replay_user_errors_are_one_line(tiny_campaign, capsys, argv, message):
    version = tiny_campaign["result"]["rounds"][2]["trajectory_version"]
    assert main(["replay", "--trajectories", version, *argv, "--storage", tiny_campaign["storage"]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
