"""A model version's markdown description: pure formatting by table, then written by a real evaluation
into a real MLflow registry (SQLite) and read back."""

import pytest

from tasks.publish.describe import prefect_ui_url, trajectory_origin, version_description

TAGS = {
    "round": "3",
    "run_id": "nightly",
    "parent_model_version": "policy/3",
    "trajectory_version": "ab12cd34ef56",
    "base_model": "builtin-addition-v2",
    "config_hash": "h1",
    "code_version": "git:abc",
    "prefect_flow_run_id": "0b5e",
    "eval.accuracy": "0.8",
    "eval.accuracy_train_precision": "0.825",
    "eval.engine": "embedded",
    "eval.dtype": "bfloat16",
    "eval.prompts": "500.0",
}


@pytest.mark.parametrize(
    "body, expected",
    [
        # a round's own version: the campaign and round that collected it
        ({"run_id": "nightly", "round": 3}, "collected by round 3 of campaign `nightly`"),
        # a re-filtered version: its parent and the predicate
        ({"parent": "ff00", "derivation": {"where": "reward > 0"}}, "derived from `ff00` (rows where `reward > 0`)"),
        # regrouped as well
        ({"parent": "ff00", "derivation": {"where": "true", "regroup": True}}, "rows where `true`, regrouped"),
        # re-verified rows
        (
            {"parent": "ff00", "derivation": {"reverify": {"rows": 4, "where": "outcome = 'infra_failure'"}}},
            "4 rows verified again where `outcome = 'infra_failure'`",
        ),
        # a version the storage root does not hold
        (None, "not found in the storage root"),
    ],
)
def test_trajectory_origin(body, expected):
    assert expected in trajectory_origin(body)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),  # ephemeral API: no page to link to
        ({"PREFECT_API_URL": "http://127.0.0.1:4200/api"}, "http://127.0.0.1:4200"),  # the API's UI
        ({"PREFECT_API_URL": "http://h/api", "PREFECT_UI_URL": "https://ui.example/"}, "https://ui.example"),  # UI wins
    ],
)
def test_prefect_ui_url(monkeypatch, env, expected):
    for var in ("PREFECT_API_URL", "PREFECT_UI_URL"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert prefect_ui_url() == expected


def test_description_says_round_parent_trajectories_evaluation_and_flow_run():
    text = version_description(
        "policy/4", TAGS, "collected by round 3 of campaign `nightly`", "http://ui/runs/flow-run/0b5e"
    )
    assert "round 3 of campaign `nightly`" in text
    assert "[policy/3](#/models/policy/versions/3)" in text  # the parent as a link to its page
    assert "`ab12cd34ef56`, collected by round 3" in text
    assert "80.0% held-out accuracy at serving precision (embedded, bfloat16)" in text
    assert "82.5% at training precision" in text and "over 500 prompts" in text
    assert "[0b5e](http://ui/runs/flow-run/0b5e)" in text


def test_base_description_has_no_parent_link_trajectories_or_flow_run():
    base = {**TAGS, "parent_model_version": "none", "trajectory_version": "none"}
    base = {k: v for k, v in base.items() if not k.startswith("eval.")}
    text = version_description("policy/1", base, None, None)
    assert "Parent: none (the base policy)" in text and "Trajectories: none" in text
    assert "not evaluated" in text and "Prefect flow run" not in text


def test_an_evaluated_round_version_carries_its_description(tmp_path, tiny_policy_dir, monkeypatch):
    """run_evaluate writes the description after the tags; the registry hands it back unchanged."""
    from mlflow import MlflowClient

    from storage.paths import StorageRoot
    from storage.settings import settings
    from storage.tracking import LINEAGE_TAGS, Tracker
    from tasks.config.evaluate import EvaluateConfig
    from tasks.config.prompts import PromptsConfig
    from tasks.config.verify import VerifyConfig
    from tasks.evaluate.stage import run_evaluate
    from tasks.publish.stage import lineage_tags
    from tasks.round.context import RoundContext
    from tasks.serving.live import LiveEngines

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4321/api")
    storage = str(tmp_path / "data")
    tracker = Tracker.connect(settings(), StorageRoot.of(storage))
    run = tracker.ensure_run(tracker.experiment_id("describe"), "describe", {"rlrounds.test": "describe"})
    ctx = RoundContext(
        storage=storage,
        run_id="desc",
        round=1,
        experiment="describe",
        parent_checkpoint="unused",
        parent_policy_version=0,
        parent_model_version="desc-policy/7",
        base_model="tiny",
        config_hash="h",
        code_version="test",
        flow_run_id="1234-abcd",
        mlflow_run_id=run,
        seed=0,
    )
    tags = lineage_tags(ctx, trajectory_version="0123456789ab", line="addition")
    version = tracker.register("desc-policy", tiny_policy_dir, run, tags)
    with LiveEngines() as engines:
        stats = run_evaluate(
            ctx=ctx,
            config=EvaluateConfig(),
            prompts=PromptsConfig(),
            verify=VerifyConfig(verifier="addition"),
            checkpoint=tiny_policy_dir,
            model_version=f"desc-policy/{version}",
            engines=engines,
        ).metrics()
    db = f"sqlite:///{storage}/mlflow.db"
    read = MlflowClient(tracking_uri=db, registry_uri=db).get_model_version("desc-policy", version)
    assert f"**desc-policy/{version}**: round 1 of campaign `desc`" in read.description
    assert "[desc-policy/7](#/models/desc-policy/versions/7)" in read.description
    assert "`0123456789ab`, not found in the storage root" in read.description
    serving = f"{stats['eval/accuracy']:.1%} held-out accuracy at serving precision (embedded, bfloat16)"
    assert serving in read.description
    assert "[1234-abcd](http://127.0.0.1:4321/runs/flow-run/1234-abcd)" in read.description
    assert all(read.tags[t] == tags[t] for t in LINEAGE_TAGS)  # the tags stay as they were


@pytest.mark.parametrize(
    "ref, expected",
    [
        ("rlrounds-policy@champion", ("rlrounds-policy", "champion", None)),  # an alias
        ("rlrounds-policy/3", ("rlrounds-policy", None, "3")),  # a version
        (" p@nightly-2 ", ("p", "nightly-2", None)),  # spaces around a form entry are ignored
    ],
)
def test_parse_start(ref, expected):
    from tasks.campaign.start import parse_start

    assert parse_start(ref) == expected


@pytest.mark.parametrize("ref", ["rlrounds-policy", "p/three", "p@", "/3", "runs/x/rounds/3/checkpoint@a"])
def test_parse_start_refuses_anything_else_naming_the_forms(ref):
    from storage.model_versions import LineageError
    from tasks.campaign.start import parse_start

    with pytest.raises(LineageError, match="NAME@ALIAS"):
        parse_start(ref)
