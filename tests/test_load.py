"""Load: four campaigns and a replay at once on one fresh storage root, local and on S3 (moto).

Each is a separate `rlrounds` process, as when flows are scheduled together from the Prefect UI: each
starts its own ephemeral Prefect server, and all of them open one new MLflow store. Two campaigns train
the default line (the built-in addition held-out set), two another one (a held-out file), and the replay
retrains campaign A's round 1 while the campaigns still run. Afterwards: every process exited 0, every
round is committed once, every model version is registered once with its lineage tags, no trajectory
row is lost or duplicated, and each line has its own champion from its own campaigns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from storage.tracking import LINE_TAG, LINEAGE_TAGS

# slow too, so that `-m "not slow"` (which replaces the default `-m "not load"`) leaves it out as well
pytestmark = [pytest.mark.load, pytest.mark.slow]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUNDS = 2
DEFAULT_LINE = "addition"
TIMEOUT_S = 900


def _config(run_id: str, held_out: str | None) -> dict:
    round_config: dict = {"train": {"groups_per_step": 2, "steps_per_round": 2}}
    if held_out:
        round_config["evaluate"] = {"source": held_out}
    return {"rounds": ROUNDS, "run_id": run_id, "round": round_config}


def _held_out_file(path) -> str:
    """40 prompts of the built-in addition task's held-out set: a line of its own."""
    from models.builtin import addition

    with open(path, "w") as f:
        for p in addition.held_out_prompts()[:40]:
            f.write(json.dumps({"prompt": p.text, "reference": p.reference}) + "\n")
    return str(path)


def _rlrounds(args: list[str], env: dict, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *args], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
    )


def _stage_output(root, run_id: str, round_index: int, stage: str) -> dict | None:
    try:
        with root.fs.open(root.stage_record(run_id, round_index, stage), "rb") as f:
            return json.loads(f.read())["output"]
    except (FileNotFoundError, ValueError):
        return None


def run_load(storage: str, home, seed_builtin_base) -> dict:
    """Start the four campaigns, then the replay once campaign A's round 1 is committed; wait for all."""
    from storage.paths import StorageRoot

    seed_builtin_base(storage)  # the base-policy cache: building it is not what is under load
    root = StorageRoot.of(storage)
    held_out = _held_out_file(home / "heldout.jsonl")
    campaigns = {
        "load-a": None,
        "load-b": None,
        "load-c": held_out,
        "load-d": held_out,
    }
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
        "PREFECT_HOME": str(home / "prefect"),  # a new user's: the processes share it
    }
    env.pop("RLROUNDS_MLFLOW_URI", None)
    logs, procs = {}, {}
    start = time.monotonic()
    for run_id, source in campaigns.items():
        config_file = home / f"{run_id}.json"
        config_file.write_text(json.dumps(_config(run_id, source)))
        logs[run_id] = open(home / f"{run_id}.log", "w")
        procs[run_id] = _rlrounds(["run", "--config", str(config_file), "--storage", storage], env, logs[run_id])
    try:
        deadline = start + TIMEOUT_S
        while (trained := _stage_output(root, "load-a", 1, "filter")) is None or (
            base := _stage_output(root, "load-a", 0, "base")
        ) is None:
            assert time.monotonic() < deadline, "campaign load-a committed no round 1 trajectories in time"
            assert procs["load-a"].poll() is None, "campaign load-a exited before its round 1 was committed"
            time.sleep(1)
        replay_args = ["replay", "--trajectories", trained["version"], "--from-model", base["model_version"]]
        replay_args += ["--config", str(home / "load-a.json"), "--storage", storage]
        logs["replay"] = open(home / "replay.log", "w")
        procs["replay"] = _rlrounds(replay_args, env, logs["replay"])
        codes = {name: proc.wait(timeout=max(1.0, deadline - time.monotonic())) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs.values():
            log.close()
    wall = time.monotonic() - start
    outputs = {name: (home / f"{name}.log").read_text() for name in procs}
    for name, code in codes.items():
        assert code == 0, f"{name} exited {code}:\n{outputs[name][-4000:]}"
    retries = sum(text.lower().count("retry") + text.count("database is locked") for text in outputs.values())
    print(f"\nload on {storage}: 4 campaigns x {ROUNDS} rounds and a replay in {wall:.0f} s; {retries} retry lines")
    return {"root": root, "campaigns": campaigns, "outputs": outputs, "replay_of": (trained, base)}


def check_load(load: dict) -> None:
    from storage.settings import settings
    from storage.tracking import Tracker
    from storage.trajectories import list_manifests, read_table

    root, campaigns = load["root"], load["campaigns"]
    # every round committed once: one trajectory version, one checkpoint, every stage recorded
    rollouts = [m for m in list_manifests(root) if m.kind == "rollout"]
    committed = sorted((m.body["run_id"], m.body["round"]) for m in rollouts)
    assert committed == sorted((r, k) for r in campaigns for k in range(1, ROUNDS + 1))
    version_of = {(m.body["run_id"], m.body["round"]): m.version for m in rollouts}
    for run_id in campaigns:
        for k in range(1, ROUNDS + 1):
            for stage in ("rollout", "filter", "train", "publish", "evaluate", "record"):
                assert _stage_output(root, run_id, k, stage) is not None, (run_id, k, stage)
    # no trajectory row lost or duplicated: the rows read back are the manifest's, each sample once
    for m in rollouts:
        rows = read_table(root, m).to_pylist()
        assert len(rows) == m.rows > 0, m.version
        assert len({(r["group_id"], r["sample_index"]) for r in rows}) == len(rows), m.version
        assert {(r["run_id"], r["round"]) for r in rows} == {(m.body["run_id"], m.body["round"])}

    # every model version registered once, with its lineage tags and its line
    tracker = Tracker.connect(settings(), root, must_exist=True)
    lines: dict[str, str] = {}
    for run_id, source in campaigns.items():
        published = _stage_output(root, run_id, 1, "publish")["model_version"]
        name = published.rsplit("/", 1)[0]
        lines[run_id] = name
        assert (name == f"rlrounds-{DEFAULT_LINE}") == (source is None)
    for name in set(lines.values()):
        versions = tracker.client.search_model_versions(f"name = '{name}'")
        keys = [(v.tags["run_id"], v.tags["round"]) for v in versions]
        assert len(keys) == len(set(keys)), f"{name}: a version registered twice: {sorted(keys)}"
        line = versions[0].tags[LINE_TAG]
        for v in versions:
            assert all(v.tags.get(t) for t in LINEAGE_TAGS), v.tags
            assert v.tags[LINE_TAG] == line and v.tags["round"] in {str(k) for k in range(ROUNDS + 1)}
            if v.tags.get("kind") != "replay":
                assert v.tags["trajectory_version"] == version_of.get((v.tags["run_id"], int(v.tags["round"])), "none")
        expected = {(r, str(k)) for r, n in lines.items() if n == name for k in range(ROUNDS + 1)}
        assert {k for k in keys if not k[0].startswith("replay-")} == expected
        # the champion is one of this line's versions: no other line's campaign moved it
        champion = tracker.client.get_model_version_by_alias(name, "champion")
        assert champion.tags[LINE_TAG] == line and champion.tags.get("kind") != "replay"
    assert len(set(lines.values())) == 2

    trained, base = load["replay_of"]
    replays = tracker.client.search_model_versions(f"name = '{lines['load-a']}' and tags.kind = 'replay'")
    assert len(replays) == 1  # registered once
    tags = replays[0].tags
    assert (tags["trajectory_version"], tags["parent_model_version"]) == (trained["version"], base["model_version"])
    assert tags[LINE_TAG] == DEFAULT_LINE and "eval.accuracy" in tags


def test_four_campaigns_and_a_replay_on_one_local_root(tmp_path, seed_builtin_base):
    check_load(run_load(str(tmp_path / "data"), tmp_path, seed_builtin_base))


def test_four_campaigns_and_a_replay_on_one_s3_root(tmp_path, s3_endpoint, seed_builtin_base):
    check_load(run_load(f"s3://rlrounds-test/load-{uuid.uuid4().hex[:8]}", tmp_path, seed_builtin_base))
