"""The trainer worker group on Ray (train.workers 2, gloo on CPU) in real campaigns: a default round at 2
workers lands where 1 worker lands, the group lives across rounds and is gone when the campaign ends,
a worker killed mid-round fails the round naming it and ``--resume`` then finishes with the uninterrupted
result, a 2-worker round replays bit for bit at 2 workers, and lineage records who trained each checkpoint.

Each campaign runs as ``rlrounds run`` in a process of its own, with its own local Ray, as a user runs it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILL_BOUND_S = 60  # a dead worker fails its round within this


def _campaign(workers: int, run_id: str, rounds: int = 1) -> dict:
    return {
        "rounds": rounds,
        "run_id": run_id,
        "round": {"device": "cpu", "train": {"workers": workers}, "publish": {"model_name": f"group-{run_id}"}},
    }


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return env


def _start(tmp_path, storage: str, config: dict, *extra: str) -> subprocess.Popen:
    path = tmp_path / f"{config['run_id']}-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "flows.cli", "run", "--storage", storage]
    command += ["--resume", config["run_id"]] if "--resume" in extra else ["--config", str(path)]
    return subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(tmp_path, storage: str, config: dict, *extra: str) -> str:
    process = _start(tmp_path, storage, config, *extra)
    out, err = process.communicate(timeout=1500)
    assert process.returncode == 0, (out + err)[-3000:]
    return out


def _workers() -> list[int]:
    found = subprocess.run(["pgrep", "-f", "ray::TrainWorker"], capture_output=True, text=True).stdout
    return [int(pid) for pid in found.split()]


def _weights(storage: str, run_id: str, round_index: int) -> dict:
    from safetensors.torch import load_file

    from storage.paths import StorageRoot

    return load_file(os.path.join(StorageRoot.of(storage).checkpoint(run_id, round_index), "model.safetensors"))


def _lineage(storage: str, run_id: str, round_index: int) -> dict:
    from storage.paths import StorageRoot

    with open(os.path.join(StorageRoot.of(storage).checkpoint(run_id, round_index), "lineage.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory, seed_builtin_base) -> tuple:
    """A storage root holding the built-in base, and a folder for configs."""
    home = tmp_path_factory.mktemp("train-group")
    seed_builtin_base(str(home / "data"))
    return home, str(home / "data")


@pytest.fixture(scope="module")
def rounds(seeded) -> dict:
    """One default round from the built-in base at 1 worker and at 2 (two rounds, to see the group live on)."""
    home, storage = seeded
    out = {"storage": storage, "home": home}
    out["w1"] = _run(home, storage, _campaign(1, "w1"))
    out["w2"] = _run(home, storage, _campaign(2, "w2", rounds=2))
    return out


def test_two_workers_train_a_default_round_as_one_does(rounds):
    import torch

    one, two = _weights(rounds["storage"], "w1", 1), _weights(rounds["storage"], "w2", 1)
    diffs = torch.cat([(one[k] - two[k]).abs().flatten() for k in one])
    assert float(diffs.max()) < 1e-3 and float(diffs.mean()) < 1e-6, (float(diffs.max()), float(diffs.mean()))
    assert _lineage(rounds["storage"], "w2", 1)["trained_on"] == {"workers": 2, "device": "cpu", "precision": "fp32"}
    assert _lineage(rounds["storage"], "w1", 1)["trained_on"] == {"workers": 1, "device": "cpu", "precision": "fp32"}
    # the held-out accuracy each printed for round 1 agrees within noise
    accuracy = {}
    for name in ("w1", "w2"):
        line = next(line for line in rounds[name].splitlines() if line.startswith("round 1"))
        accuracy[name] = float(line.split("held-out accuracy ")[1].split("%")[0])
    assert abs(accuracy["w1"] - accuracy["w2"]) <= 3.0, accuracy
    assert _workers() == [], "the campaigns ended: no trainer worker may be left"


def test_the_group_lives_across_rounds_and_lineage_says_who_trained(rounds):
    """Round 2 of the 2-worker campaign trained on the group round 1 started; each registered version is
    tagged with the worker count, device and precision that trained it."""
    from mlflow import MlflowClient

    db = f"sqlite:///{rounds['storage']}/mlflow.db"
    client = MlflowClient(tracking_uri=db, registry_uri=db)
    versions = sorted(client.search_model_versions("name = 'group-w2'"), key=lambda v: int(v.version))
    assert [v.tags["round"] for v in versions] == ["0", "1", "2"]
    assert [client.get_run(v.run_id).data.metrics["train/group_rounds"] for v in versions[1:]] == [1.0, 2.0]
    for v in versions[1:]:
        assert (v.tags["trained_on.workers"], v.tags["trained_on.device"], v.tags["trained_on.precision"]) == (
            "2",
            "cpu",
            "fp32",
        )


def test_a_killed_worker_fails_the_round_naming_it_and_resume_finishes_it(rounds, tmp_path):
    """SIGKILL one worker once the group trains round 1: the campaign fails within KILL_BOUND_S with the
    worker named, leaves no worker behind, and ``--resume`` commits round 1 with the weights of the
    uninterrupted 2-worker round, bit for bit."""
    from storage import checkpoints
    from storage.paths import StorageRoot

    storage = rounds["storage"]
    config = _campaign(2, "killed")
    process = _start(tmp_path, storage, config)
    try:
        deadline = time.monotonic() + 900
        while len(_workers()) < 2 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.2)
        victims = _workers()
        assert len(victims) == 2, "the group never started"
        time.sleep(3)  # into the round's training
        os.kill(victims[-1], signal.SIGKILL)
        killed_at = time.monotonic()
        out, err = process.communicate(timeout=KILL_BOUND_S + 60)
        assert time.monotonic() - killed_at < KILL_BOUND_S, "the round did not fail within the bound"
    finally:
        process.kill()
    assert process.returncode != 0
    assert "trainer worker" in err and "failed during train" in err, err[-3000:]
    assert not checkpoints.is_committed(StorageRoot.of(storage), StorageRoot.of(storage).checkpoint("killed", 1))
    time.sleep(2)
    assert _workers() == [], "a killed campaign's workers were left running"

    _run(tmp_path, storage, config, "--resume")
    resumed, uninterrupted = _weights(storage, "killed", 1), _weights(storage, "w2", 1)
    assert all(resumed[k].equal(uninterrupted[k]) for k in uninterrupted)


def test_a_two_worker_round_replays_bitwise_at_two_workers(rounds):
    storage = rounds["storage"]
    lineage = _lineage(storage, "w2", 2)
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "replay", "--storage", storage, "--no-evaluate"]
        + ["--trajectories", lineage["trajectory_version"], "--from-model", lineage["parent_model_version"]],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )  # the training config recorded with the round: 2 workers
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    replayed = done.stdout.strip().splitlines()[-1].split("; checkpoint ")[1].strip()
    from safetensors.torch import load_file

    again, original = load_file(os.path.join(replayed, "model.safetensors")), _weights(storage, "w2", 2)
    assert all(again[k].equal(original[k]) for k in original)
    assert _workers() == []


def test_a_sigtermed_campaign_stops_its_worker_group_and_its_ray(seeded, tmp_path):
    """SIGTERM while the group trains: the campaign exits 143 and nothing it started is left, neither the
    trainer workers nor the local Ray that holds them (every process it marked is gone)."""
    from tests.test_orphans import _marked_by

    process = _start(tmp_path, seeded[1], _campaign(2, "sigterm"))
    try:
        deadline = time.monotonic() + 900
        while len(_workers()) < 2 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.2)
        assert len(_workers()) == 2, "the group never started"
        started = _marked_by(process.pid)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
        assert process.returncode == 128 + signal.SIGTERM, err[-2000:]
    finally:
        process.kill()
    time.sleep(2)
    assert _workers() == []
    assert [pid for pid in started if os.path.exists(f"/proc/{pid}") and _alive(pid)] == []


def _alive(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
