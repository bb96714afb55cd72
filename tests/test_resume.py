"""Resumable campaigns: each stage once per (run, round, stage, inputs), and a campaign killed at every stage
boundary that resumes to exactly the uninterrupted result (ownership and records: test_campaign_records.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC
from typing import Annotated

import pytest

from storage.campaigns import CampaignError
from storage.paths import StorageRoot
from tasks.config.base import NotInput
from tasks.config.filter import FilterConfig
from tasks.round.context import RoundContext
from tasks.round.results import TrajectoryVersion


def _ctx(tmp_path, **fields):
    from tasks.round.context import RoundContext

    base = dict(
        storage=str(tmp_path),
        run_id="r1",
        round=1,
        experiment="e",
        parent_checkpoint="/p",
        parent_policy_version=0,
        parent_model_version="m/1",
        base_model="b",
        config_hash="h",
        code_version="c",
        flow_run_id="f",
        mlflow_run_id="m",
        seed=0,
    )
    return RoundContext(**{**base, **fields})


def _filter_like(
    *,
    ctx: RoundContext,
    uri: str,
    config: FilterConfig,
    temperature: float,
    stats: Annotated[dict, NotInput("a measurement")],
) -> TrajectoryVersion:
    _CALLS.append(uri)
    return TrajectoryVersion(version="v", uri=uri, stats={"n": len(_CALLS)})


_CALLS: list[str] = []


def test_stages_run_once_per_inputs(tmp_path):
    from flows.stages import Stages

    _CALLS.clear()
    ctx = _ctx(tmp_path)
    first = Stages(ctx).run(
        "filter", _filter_like, ctx=ctx, uri="/a", config=FilterConfig(), temperature=1.0, stats={"x": 1}
    )
    assert first == TrajectoryVersion(version="v", uri="/a", stats={"n": 1})
    # Another process: another flow run, code version and measurements -- the same inputs, so no second run,
    # and the recorded result comes back typed.
    again = _ctx(tmp_path, flow_run_id="f2", code_version="c2", mlflow_run_id="m2")
    stages = Stages(again)
    assert (
        stages.run("filter", _filter_like, ctx=again, uri="/a", config=FilterConfig(), temperature=1.0, stats={"x": 2})
        == first
    )
    assert _CALLS == ["/a"] and stages.skipped == ["filter"]
    with pytest.raises(CampaignError, match="other inputs"):  # an upstream version changed under a record
        Stages(ctx).run("filter", _filter_like, ctx=ctx, uri="/b", config=FilterConfig(), temperature=1.0, stats={})


def test_inputs_keys_are_what_a_stage_declares(tmp_path):
    from flows.stages import declared_inputs, inputs_key

    ctx = _ctx(tmp_path)
    args = dict(ctx=ctx, uri="/a", config=FilterConfig(), temperature=1.0, stats={})
    key = inputs_key("filter", _filter_like, args)
    assert declared_inputs(_filter_like)[0] == ["ctx", "uri", "config", "temperature"]  # stats: NotInput
    assert inputs_key("filter", _filter_like, {**args, "temperature": 0.7}) != key  # a float is an input
    assert inputs_key("filter", _filter_like, {**args, "stats": {"x": 9}}) == key  # a measurement is not
    assert inputs_key("filter", _filter_like, {**args, "ctx": _ctx(tmp_path, seed=1)}) != key  # the round's identity is
    assert (
        inputs_key("filter", _filter_like, {**args, "ctx": _ctx(tmp_path, storage="/moved", code_version="c2")}) == key
    )
    assert inputs_key("filter", _filter_like, {**args, "config": FilterConfig(epsilon=1e-5)}) != key
    with pytest.raises(TypeError):  # a missing input fails before anything runs
        inputs_key("filter", _filter_like, {k: v for k, v in args.items() if k != "uri"})


def test_every_round_stage_declares_a_typed_result():
    """The train stage's key covers the rollout temperature (its logprobs are recomputed at it)."""
    from flows import tasks
    from flows.stages import declared_inputs, stage_function

    stage_tasks = [
        tasks.register_base_task,
        tasks.rollout_task,
        tasks.filter_task,
        tasks.train_task,
        tasks.publish_task,
        tasks.evaluate_task,
        tasks.record_round_task,
    ]
    for task in stage_tasks:
        declared_inputs(stage_function(task))  # raises without a StageResult return type
    assert "temperature" in declared_inputs(stage_function(tasks.train_task))[0]


def test_the_carry_over_a_round_resumes_and_stages_is_part_of_its_keys(tmp_path):
    """Rollout resumes the previous version's carry-over and filter commits the staged one: another
    carry-over is another input, and so are the partial-rollout settings."""
    from flows import tasks
    from flows.stages import declared_inputs, inputs_key, stage_function
    from tasks.config.prompts import PromptsConfig
    from tasks.config.rollout import RolloutConfig
    from tasks.config.verify import VerifyConfig
    from tasks.serving.live import LiveEngines

    rollout, filtering = stage_function(tasks.rollout_task), stage_function(tasks.filter_task)
    assert "carry_from" in declared_inputs(rollout)[0] and "carryover" in declared_inputs(filtering)[0]
    args = dict(
        ctx=_ctx(tmp_path),
        prompts=PromptsConfig(),
        rollout=RolloutConfig(),
        verify=VerifyConfig(),
        filtering=FilterConfig(),
        target_groups=2,
        carry_from="/v1",
        engines=LiveEngines(),
    )
    key = inputs_key("rollout", rollout, args)
    assert inputs_key("rollout", rollout, {**args, "engines": LiveEngines()}) == key  # which engines: not an input
    assert inputs_key("rollout", rollout, {**args, "carry_from": "/v1-other"}) != key
    assert inputs_key("rollout", rollout, {**args, "carry_from": None}) != key
    assert inputs_key("rollout", rollout, {**args, "rollout": RolloutConfig(partial_rollouts=False)}) != key
    assert inputs_key("rollout", rollout, {**args, "rollout": RolloutConfig(verdict_wait_s=0.5)}) != key
    staged = dict(ctx=_ctx(tmp_path), staging="/s", config=FilterConfig(), target_groups=2, rollout_stats={})
    assert inputs_key("filter", filtering, {**staged, "carryover": "/c"}) != inputs_key("filter", filtering, staged)
    assert "stats" not in declared_inputs(stage_function(tasks.record_round_task))[0]


def test_crash_points_are_inert_unless_set(monkeypatch):
    from tasks.round.faults import CRASH_ENV, crash_point, crash_points

    monkeypatch.delenv(CRASH_ENV, raising=False)
    crash_point("train", 1)  # nothing happens
    monkeypatch.setenv(CRASH_ENV, "rollout:2")
    crash_point("train", 1)  # another point: nothing happens
    assert crash_points("train:1, base:0") == {("train", 1), ("base", 0)}
    with pytest.raises(ValueError, match="STAGE:ROUND"):
        crash_points("train")


def test_a_committed_round_is_found_and_not_filtered_twice(tmp_path):
    from datetime import datetime

    from storage.trajectories import (
        TrajectoryStoreError,
        committed_round_version,
        rows_to_table,
        table_bytes,
        write_version,
    )
    from tasks.config.filter import FilterConfig
    from tasks.filter.stage import run_filter

    root = StorageRoot.of(str(tmp_path))
    assert committed_round_version(root, "r1", 1) is None
    now = datetime.now(UTC)
    rows = [
        {
            "run_id": "r1",
            "round": 1,
            "prompt_id": "p",
            "group_id": "g",
            "sample_index": i,
            "task": "addition",
            "prompt_text": "1+1=",
            "prompt_token_ids": [1],
            "reference": "2",
            "completion_text": str(i + 1),
            "completion_token_ids": [4],
            "rollout_logprobs": [-1.0],
            "token_policy_versions": [0],
            "finish_reason": "stop",
            "engine": None,
            "sampling": None,
            "verifier": None,
            "reward": float(i == 1),
            "outcome": "success" if i == 1 else "model_failure",
            "verify_error": None,
            "advantage": None,
            "kept": None,
            "drop_reason": None,
            "enqueued_at": now,
            "started_at": now,
            "finished_at": now,
            "verified_at": now,
            "gen_latency_s": 0.0,
            "verify_latency_s": 0.0,
        }
        for i in range(2)
    ]
    staging = root.rollout_staging_file("r1", 1)
    root.fs.makedirs(root.staging("r1", 1), exist_ok=True)
    open(staging, "wb").write(table_bytes(rows_to_table(rows)))
    ctx = _ctx(tmp_path)
    first = run_filter(
        ctx=ctx, staging=staging, config=FilterConfig(), target_groups=1, rollout_stats={"rollout/wall_s": 1.0}
    )
    assert committed_round_version(root, "r1", 1).version == first.version and not os.path.exists(staging)
    # resumed: staging is gone
    again = run_filter(
        ctx=ctx, staging=staging, config=FilterConfig(), target_groups=1, rollout_stats={"rollout/wall_s": 2.0}
    )
    assert again.version == first.version and again.stats == first.stats and again.resumed
    assert committed_round_version(root, "r1", 1).body["rollout_stats"] == {"rollout/wall_s": 1.0}
    write_version(root, lambda v: root.trajectory_version("r1", 1, v), rows_to_table(rows[:1]), {"kind": "rollout"})
    with pytest.raises(TrajectoryStoreError, match="has 2 committed trajectory versions"):
        committed_round_version(root, "r1", 1)


# -- the crash test ------------------------------------------------------------------------------------

CRASH_CONFIG = {
    "rounds": 2,
    "experiment": "crash",
    "round": {
        "train": {"groups_per_step": 4, "steps_per_round": 2},
        "publish": {"model_name": "crash-policy"},
        "seed": 7,
    },
}
# Each resumed process dies at the next point: every stage boundary of round 1, then one in round 2.
KILL_POINTS = ["base:0", "rollout:1", "filter:1", "train:1", "publish:1", "evaluate:1", "record:1", "train:2"]
TIMING_COLUMNS = {
    "enqueued_at",
    "started_at",
    "finished_at",
    "verified_at",
    "gen_latency_s",
    "verify_latency_s",
    "trajectory_version",
}


@pytest.fixture(scope="module")
def weak_base(tmp_path_factory):
    """A small policy trained briefly (~15 s): weak (a few % accurate) but enough for mixed groups."""
    from models.builtin.base_policy import BaseRecipe, build_base_policy

    path = str(tmp_path_factory.mktemp("weak-base"))
    recipe = BaseRecipe(
        hidden_size=48,
        num_layers=2,
        intermediate_size=96,
        num_heads=2,
        max_steps=400,
        check_every=10**6,
        stop_at_accuracy=1.0,
        batch_size=64,
        learning_rate=3e-3,
        **_one_thread(),
    )
    build_base_policy(path, recipe)
    os.remove(os.path.join(path, "lineage.json"))  # a plain Hugging Face directory, like any user's base
    return path


def _one_thread() -> dict:
    from dataclasses import fields

    from models.builtin.base_policy import BaseRecipe

    return {"threads": 1} if "threads" in {f.name for f in fields(BaseRecipe)} else {}


def config_file(tmp_path, config: dict, base_model: str) -> str:
    """``config`` with ``base_model`` as its policy, written as a YAML file for `rlrounds run --config`."""
    import yaml

    path = tmp_path / "campaign.yaml"
    path.write_text(yaml.safe_dump({**config, "round": {**config["round"], "policy": {"base_model": base_model}}}))
    return str(path)


class Campaign:
    """`rlrounds run` in subprocesses sharing the test session's Prefect server; each its own process group."""

    def __init__(self, storage):
        self.storage = storage

    def run(self, *args, crash_after=None, expect_crash=False):
        from prefect.settings import PREFECT_API_URL

        env = {
            **os.environ,
            "PREFECT_API_URL": PREFECT_API_URL.value(),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "RLROUNDS_CODE_VERSION": "crash-test",
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("RLROUNDS_CRASH_AFTER", None)
        if crash_after:
            env["RLROUNDS_CRASH_AFTER"] = crash_after
        cmd = [os.path.join(os.path.dirname(sys.executable), "rlrounds"), "run", "--storage", self.storage, *args]
        start = time.perf_counter()
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=400)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever the killed campaign left behind in its group
            except ProcessLookupError:
                pass
        seconds = time.perf_counter() - start
        if expect_crash:
            assert proc.returncode == -signal.SIGKILL, out[-3000:]
            assert f"injected crash after {crash_after}" in out, out[-3000:]
        else:
            assert proc.returncode == 0, out[-3000:]
        return out, seconds


def _registry(storage):
    from mlflow import MlflowClient

    uri = f"sqlite:///{storage}/mlflow.db"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    versions = sorted(client.search_model_versions("name = 'crash-policy'"), key=lambda v: int(v.version))
    runs = client.search_runs(
        [client.get_experiment_by_name("crash").experiment_id], "tags.`rlrounds.run_id` = 'crash'"
    )
    champion = str(client.get_model_version_by_alias("crash-policy", "champion").version)
    return client, versions, runs, champion


def _trajectories(storage):
    from storage.trajectories import committed_round_version, read_table

    root = StorageRoot.of(storage)
    out = {}
    for k in (1, 2):
        manifest = committed_round_version(root, "crash", k)
        rows = read_table(root, manifest).to_pylist()
        out[k] = (manifest.version, [{c: v for c, v in r.items() if c not in TIMING_COLUMNS} for r in rows])
    return out


def _tensors(path):
    import torch
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors")), torch.load(
        os.path.join(path, "optimizer.pt"), weights_only=True
    )


def _same_tree(a, b):
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.slow
def test_killed_at_every_stage_boundary_resumes_to_the_uninterrupted_result(prefect_harness, weak_base, tmp_path):
    config_path = config_file(tmp_path, CRASH_CONFIG, weak_base)
    reference, crashed = Campaign(str(tmp_path / "reference")), Campaign(str(tmp_path / "crashed"))

    _, reference_s = reference.run("--config", str(config_path), "--run-id", "crash")
    times = {}
    _, times[KILL_POINTS[0]] = crashed.run(
        "--config", str(config_path), "--run-id", "crash", crash_after=KILL_POINTS[0], expect_crash=True
    )
    for point in KILL_POINTS[1:]:
        _, times[point] = crashed.run("--resume", "crash", crash_after=point, expect_crash=True)
    # Resume overhead: a process resumed after the last kill, dying again at the same point, only
    # re-reaches where the previous one was: start-up, the ownership and input checks, skipping
    # every recorded stage, and re-reading what train:2 had committed.
    _, overhead_s = crashed.run("--resume", "crash", crash_after=KILL_POINTS[-1], expect_crash=True)
    out, finish_s = crashed.run("--resume", "crash")
    assert "round 2:" in out and "(resumed: rollout, filter" in out

    # The registry: the same versions with the same lineage and evaluation tags, the same champion.
    _, ref_versions, ref_runs, ref_champion = _registry(reference.storage)
    client, versions, runs, champion = _registry(crashed.storage)
    assert [str(v.version) for v in versions] == [str(v.version) for v in ref_versions] == ["1", "2", "3"]  # none twice
    ref_traj, traj = _trajectories(reference.storage), _trajectories(crashed.storage)
    for ref, got in zip(ref_versions, versions):
        volatile = {"prefect_flow_run_id", "trajectory_version", "checkpoint"}  # checkpoint: a URI under its root
        assert {k: v for k, v in got.tags.items() if k not in volatile} == {
            k: v for k, v in ref.tags.items() if k not in volatile
        }
        # the same place under each root (or the same base outside both)
        assert got.tags["checkpoint"].removeprefix(crashed.storage) == ref.tags["checkpoint"].removeprefix(
            reference.storage
        )
        round_index = int(got.tags["round"])
        if round_index:  # its trajectory version: the one its round committed (ids differ only by timings)
            assert got.tags["trajectory_version"] == traj[round_index][0]
    assert champion == ref_champion
    # MLflow runs reused, not duplicated: one campaign run, one run per round, one dataset input each.
    assert sorted(r.data.tags["rlrounds.kind"] for r in runs) == sorted(r.data.tags["rlrounds.kind"] for r in ref_runs)
    assert len(runs) == 4
    for r in runs:
        if r.data.tags.get("rlrounds.round") in ("1", "2"):
            assert len(client.get_run(r.info.run_id).inputs.dataset_inputs) == 1
    # Trajectories: one version per round, every row once, identical but for the timing columns.
    for k in (1, 2):
        assert traj[k][1] == ref_traj[k][1] and len(traj[k][1]) > 0
        assert len(os.listdir(StorageRoot.of(crashed.storage).round_trajectories("crash", k))) == 1
    # Checkpoints: identical tensors, weights and optimizer state.
    for k in (1, 2):
        ref_ckpt = StorageRoot.of(reference.storage).checkpoint("crash", k)
        ckpt = StorageRoot.of(crashed.storage).checkpoint("crash", k)
        assert _same_tree(_tensors(ckpt), _tensors(ref_ckpt)), f"round {k} checkpoint differs"
    print(
        f"\nuninterrupted campaign {reference_s:.1f} s; killed at {', '.join(KILL_POINTS)}: "
        + ", ".join(f"{p} {s:.1f} s" for p, s in times.items())
        + f"; resume overhead (reaching train:2 again) {overhead_s:.1f} s; final resume {finish_s:.1f} s"
    )


@pytest.mark.slow
def test_rerunning_the_flow_with_the_same_run_id_continues_it(prefect_harness, weak_base, tmp_path, monkeypatch):
    """What a Prefect deployment re-run does: the same flow, the same run_id, no --resume flag."""
    from flows import stages
    from flows.campaign import rl_campaign
    from flows.config import CampaignConfig
    from storage.trajectories import committed_round_version

    class Stopped(Exception):
        pass

    def stop_after_train_1(stage, round_index):
        if (stage, round_index) == ("train", 1):
            raise Stopped("worker lost")  # in-process stand-in for the SIGKILL above

    config = CampaignConfig.model_validate(
        {
            **CRASH_CONFIG,
            "rounds": 1,
            "run_id": "rerun",
            "round": {**CRASH_CONFIG["round"], "policy": {"base_model": weak_base}},
        }
    )
    storage = str(tmp_path / "data")
    monkeypatch.setattr(stages, "crash_point", stop_after_train_1)
    with pytest.raises(Stopped):
        rl_campaign(config, storage=storage)  # its engines are released with it, crash or not
    monkeypatch.undo()
    result = rl_campaign(config, storage=storage)
    root = StorageRoot.of(storage)
    assert [r["round"] for r in result["rounds"]] == [0, 1]
    assert result["rounds"][1]["trajectory_version"] == committed_round_version(root, "rerun", 1).version
    assert result["final_model_version"] == "crash-policy/2"  # base + round 1, nothing registered twice
    assert json.load(open(root.stage_record("rerun", 1, "train")))["output"]["resumed"] is True
