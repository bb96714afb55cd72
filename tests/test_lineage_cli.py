"""`rlrounds lineage`: every step from a model version back to the base, from the registry and the
manifests alone, with every field filled."""

import json

import pytest

from flows.cli import main
from models.builtin.base_policy import RECIPE_VERSION

pytestmark = pytest.mark.slow

FIELDS = ("run_id", "config_hash", "code_version", "prefect_flow_run_id", "base_model", "checkpoint")


def test_lineage_of_a_three_round_campaign_lists_every_round_and_the_base(tiny_campaign, capsys):
    storage, rounds = tiny_campaign["storage"], tiny_campaign["result"]["rounds"]
    final = tiny_campaign["result"]["final_model_version"]
    capsys.readouterr()
    assert final == rounds[3]["model_version"] == "tiny-policy/4"

    assert main(["lineage", final, "--storage", storage]) == 0
    text = capsys.readouterr().out
    assert text.startswith(
        f"lineage of tiny-policy/4: 3 trained step(s) back to the base builtin-addition-v{RECIPE_VERSION}\n"
    )
    for k in (3, 2, 1):
        assert f"tiny-policy/{k + 1}  round {k}  (round of run tiny)" in text
        assert f"{rounds[k]['trajectory_version']} rollout of run tiny round {k}" in text
    assert "tiny-policy/1  round 0  (base policy)" in text and "n/a" not in text and "not evaluated" not in text
    assert text.count("  line          addition") == 4  # every step names its promotion line
    assert text.count("[champion]") <= 1

    assert main(["lineage", final, "--json", "--storage", storage]) == 0
    steps = json.loads(capsys.readouterr().out)
    assert [s["model_version"] for s in steps] == ["tiny-policy/4", "tiny-policy/3", "tiny-policy/2", "tiny-policy/1"]
    assert [s["round"] for s in steps] == ["3", "2", "1", "0"]
    assert [s["parent_model_version"] for s in steps] == ["tiny-policy/3", "tiny-policy/2", "tiny-policy/1", "none"]
    for step in steps:
        assert all(step[f] and step[f] not in ("none", "unknown") for f in FIELDS), step
        assert step["line"] == "addition" and set(step["aliases"]) <= {"champion"}
        assert 0.0 <= float(step["evaluation"]["accuracy"]) <= 1.0 and step["evaluation"]["dtype"] == "bfloat16"
    for step, k in zip(steps[:3], (3, 2, 1)):
        assert step["kind"] == "round" and step["trajectory_version"] == rounds[k]["trajectory_version"]
        origin = step["derivation"][0]
        assert (origin["kind"], origin["run_id"], origin["round"], origin["policy_version"]) == (
            "rollout",
            "tiny",
            k,
            k - 1,
        )
        assert origin["rows"] > 0 and origin["target_groups"] == 4
    assert steps[3]["kind"] == "base" and steps[3]["trajectory_version"] == "none" and steps[3]["derivation"] == []
    assert len({s["prefect_flow_run_id"] for s in steps}) == 4  # each round its own flow run (the base: the campaign's)


def test_lineage_through_a_replay_of_a_derived_version(tiny_campaign, capsys):
    from flows.config import ReplayRequest
    from flows.replay import rl_replay

    storage, rounds = tiny_campaign["storage"], tiny_campaign["result"]["rounds"]
    where = "outcome <> 'infra_failure'"
    capsys.readouterr()
    assert main(["refilter", rounds[3]["trajectory_version"], "--where", where, "--regroup", "--storage", storage]) == 0
    derived = capsys.readouterr().out.split()[2]
    replay = rl_replay(ReplayRequest(trajectories=derived, from_model=rounds[2]["model_version"]), storage=storage)

    assert main(["lineage", replay["model_version"], "--json", "--storage", storage]) == 0
    steps = json.loads(capsys.readouterr().out)
    assert [s["model_version"] for s in steps] == [
        replay["model_version"],
        "tiny-policy/3",
        "tiny-policy/2",
        "tiny-policy/1",
    ]
    top = steps[0]
    assert top["kind"] == "replay" and top["run_id"] == replay["replay_id"] and top["trajectory_version"] == derived
    assert [(d["version"], d["kind"]) for d in top["derivation"]] == [
        (derived, "derived"),
        (rounds[3]["trajectory_version"], "rollout"),
    ]
    assert top["derivation"][0]["where"] == where and top["derivation"][0]["regroup"] is True
    assert all(top[f] for f in FIELDS) and "accuracy" in top["evaluation"]
    assert top["line"] == "addition" and "champion" not in top["aliases"]  # a replay never takes the alias

    assert main(["lineage", replay["model_version"], "--storage", storage]) == 0
    text = capsys.readouterr().out
    assert f"(replay of run {replay['replay_id']})" in text
    assert (
        f'{derived} derived where "{where}", regrouped' in text
        and f"<- {rounds[3]['trajectory_version']} rollout" in text
    )


@pytest.mark.parametrize(
    "ref, message",
    [
        ("tiny-policy", "must look like NAME/VERSION"),
        ("tiny-policy/99", "no registered model version tiny-policy/99"),
    ],
)
def test_lineage_user_errors_are_one_line(tiny_campaign, capsys, ref, message):
    assert main(["lineage", ref, "--storage", tiny_campaign["storage"]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_lineage_needs_an_existing_registry(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["lineage", "tiny-policy/1", "--storage", str(tmp_path / "empty")]) == 2
    assert "no MLflow registry at" in capsys.readouterr().err
    assert not (tmp_path / "empty" / "mlflow.db").exists()  # reading never creates a store
