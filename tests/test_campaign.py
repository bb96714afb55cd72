"""A real campaign, end to end on CPU: Prefect flow runs, MLflow runs and registry, Parquet trajectories,
Hugging Face checkpoints. Tiny rounds, real parts."""

import asyncio
import json
import os

import pytest

from flows.config import CampaignConfig
from storage.paths import StorageRoot
from storage.tracking import LINEAGE_TAGS
from storage.trajectories import arrow_schema, list_manifests, read_table

pytestmark = pytest.mark.slow

TINY = {
    "rounds": 2,
    "run_id": "it-campaign",
    "round": {"train": {"groups_per_step": 8, "steps_per_round": 2}, "publish": {"model_name": "it-policy"}},
}


@pytest.fixture(scope="module")
def campaign(prefect_harness, tmp_path_factory):
    from flows.campaign import rl_campaign

    storage = str(tmp_path_factory.mktemp("campaign") / "data")
    result = rl_campaign(CampaignConfig.model_validate(TINY), storage=storage)
    return storage, result


def test_one_committed_trajectory_version_per_round(campaign):
    storage, result = campaign
    root = StorageRoot.of(storage)
    manifests = sorted(list_manifests(root), key=lambda m: m.body["round"])
    assert [m.body["round"] for m in manifests] == [1, 2]
    assert [m.version for m in manifests] == [r["trajectory_version"] for r in result["rounds"][1:]]
    table = read_table(root, manifests[0])
    assert set(arrow_schema().names) | {"trajectory_version"} == set(table.column_names)
    rows = table.to_pylist()
    kept = [r for r in rows if r["kept"]]
    assert len({r["group_id"] for r in kept}) == 16  # groups_per_step x steps_per_round
    for r in rows:
        assert len(r["completion_token_ids"]) == len(r["rollout_logprobs"]) == len(r["token_policy_versions"]) >= 1
        assert r["token_policy_versions"] == [0] * len(r["completion_token_ids"])  # round 1 samples the base
        assert r["outcome"] in ("success", "model_failure") and r["finish_reason"] in ("stop", "length")
        assert r["kept"] or r["drop_reason"]
    assert {r["round"] for r in read_table(root, manifests[1]).to_pylist()} == {2}


def test_one_checkpoint_per_round_with_lineage(campaign):
    storage, result = campaign
    for k in (1, 2):
        ckpt = StorageRoot.of(storage).checkpoint("it-campaign", k)
        files = set(os.listdir(ckpt))
        assert {"config.json", "model.safetensors", "tokenizer_config.json", "optimizer.pt", "lineage.json"} <= files
        lineage = json.load(open(os.path.join(ckpt, "lineage.json")))
        assert lineage["round"] == k and lineage["trajectory_version"] == result["rounds"][k]["trajectory_version"]
        assert lineage["parent_model_version"] == result["rounds"][k - 1]["model_version"]


def test_registry_holds_every_round_with_lineage_and_evaluation(campaign):
    from mlflow import MlflowClient

    storage, result = campaign
    client = MlflowClient(tracking_uri=f"sqlite:///{storage}/mlflow.db", registry_uri=f"sqlite:///{storage}/mlflow.db")
    versions = sorted(client.search_model_versions("name = 'it-policy'"), key=lambda v: int(v.version))
    assert [v.tags["round"] for v in versions] == ["0", "1", "2"]
    for v in versions:
        assert all(v.tags.get(t) for t in LINEAGE_TAGS), v.tags
        assert 0.0 <= float(v.tags["eval.accuracy"]) <= 1.0
        assert v.tags["eval.dtype"] == "bfloat16"  # served at bfloat16 by default
    assert versions[1].tags["parent_model_version"] == "it-policy/1"
    assert versions[2].tags["parent_model_version"] == "it-policy/2"
    assert versions[2].tags["trajectory_version"] == result["rounds"][2]["trajectory_version"]
    assert str(client.get_model_version_by_alias("it-policy", "champion").version) in {"1", "2", "3"}
    round_run = client.get_run(versions[2].run_id)
    metrics = round_run.data.metrics
    for prefix in ("rollout/", "verify/", "filter/", "train/", "publish/", "eval/", "time/"):
        assert any(k.startswith(prefix) for k in metrics), prefix
    assert metrics["publish/latency_s"] >= metrics["publish/engine_pause_s"] >= 0
    assert round_run.data.tags["mlflow.parentRunId"]  # child of the campaign run
    assert [d.dataset.digest for d in round_run.inputs.dataset_inputs] == [result["rounds"][2]["trajectory_version"]]
    base_run = client.get_run(versions[0].run_id)
    assert "eval/accuracy" in base_run.data.metrics  # the base evaluated once, as round 0


def test_prefect_recorded_rounds_and_reports(campaign):
    from prefect.client.orchestration import get_client

    async def fetch():
        async with get_client() as client:
            runs = await client.read_flow_runs()
            artifacts = await client.read_artifacts()
            return runs, artifacts

    runs, artifacts = asyncio.run(fetch())
    names = {r.name for r in runs if r.state and r.state.is_completed()}
    assert {"it-campaign-round-1", "it-campaign-round-2"} <= names
    reports = [a for a in artifacts if a.key and a.key.startswith("round-it-campaign-")]
    assert len(reports) >= 2 and "time to a trainable batch" in reports[0].data


def test_rounds_run_without_a_heartbeat_thread_of_their_own():
    """Prefect joins a flow run's heartbeat thread at its end, up to a second after every round
    (benchmarks/subflow_overhead.py); rounds turn it off for themselves only."""
    from prefect.settings import get_current_settings

    from flows.round import without_heartbeat

    assert get_current_settings().flows.heartbeat_frequency is not None  # the campaign's run keeps one
    with without_heartbeat():
        assert get_current_settings().flows.heartbeat_frequency is None
    assert get_current_settings().flows.heartbeat_frequency is not None
