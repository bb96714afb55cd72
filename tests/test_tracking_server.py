"""Rounds through an MLflow tracking server: `rlrounds tracking-server` serves a root's own store, a campaign
logs and registers through it (RLROUNDS_MLFLOW_URI), and the registry reads back through it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from storage.tracking import CHECKPOINT_TAG, LINE_TAG, LINEAGE_TAGS

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # fields[2]: the process group (field 5 of stat)
            found.append(int(name))
    return found


def start_server(storage: str, port: int, timeout_s: float = 240) -> subprocess.Popen:
    """`rlrounds tracking-server` in its own process group, once /health answers."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    env.pop("RLROUNDS_MLFLOW_URI", None)
    command = [sys.executable, "-m", "flows.cli", "tracking-server", "--storage", storage, "--port", str(port)]
    command += ["--workers", "1"]
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"tracking server exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
            return proc
        except OSError:
            time.sleep(0.5)
    stop_server(proc)
    raise AssertionError(f"tracking server on port {port} did not answer within {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> list[int]:
    """Stop the server and its workers; returns what still ran afterwards (nothing, if all went well)."""
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()
            if not group_members(proc.pid):
                break
            time.sleep(0.2)
        if not group_members(proc.pid):
            break
    proc.wait(timeout=10)
    return group_members(proc.pid)


def test_a_campaign_registers_through_the_tracking_server(
    tmp_path, prefect_harness, seed_builtin_base, monkeypatch, capsys
):
    from mlflow import MlflowClient

    from flows.campaign import rl_campaign
    from flows.cli import main
    from flows.config import CampaignConfig
    from storage.paths import StorageRoot
    from storage.settings import settings
    from storage.tracking import Tracker

    storage = str(tmp_path / "data")
    seed_builtin_base(storage)
    port = free_port()
    server = start_server(storage, port)
    uri = f"http://127.0.0.1:{port}"
    try:
        monkeypatch.setenv("RLROUNDS_MLFLOW_URI", uri)
        config = {"rounds": 1, "run_id": "served", "round": {"train": {"groups_per_step": 2, "steps_per_round": 2}}}
        result = rl_campaign(CampaignConfig.model_validate(config), storage=storage)

        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        versions = sorted(client.search_model_versions("name = 'rlrounds-addition'"), key=lambda v: int(v.version))
        assert [v.tags["round"] for v in versions] == ["0", "1"]  # the default name: the campaign's line
        root = StorageRoot.of(storage)
        for v in versions:
            assert all(v.tags.get(t) for t in LINEAGE_TAGS), v.tags
            assert v.tags[LINE_TAG] == "addition" and "eval.accuracy" in v.tags
        # the server takes a local source only inside the run's artifacts; the checkpoint is its tag
        assert versions[1].tags[CHECKPOINT_TAG] == root.checkpoint("served", 1)
        assert versions[1].tags["trajectory_version"] == result["rounds"][1]["trajectory_version"]
        assert versions[1].tags["parent_model_version"] == "rlrounds-addition/1"
        assert str(client.get_model_version_by_alias("rlrounds-addition", "champion").version) in {"1", "2"}

        capsys.readouterr()
        assert main(["lineage", "rlrounds-addition/2", "--storage", storage]) == 0  # read through the server
        text = capsys.readouterr().out
        assert f"checkpoint    {root.checkpoint('served', 1)}" in text and "  line          addition" in text
    finally:
        left = stop_server(server)
    assert left == [], f"processes of the tracking server still run: {left}"

    # the server wrote into the root's own store: without it, rounds and audits see the same registry
    monkeypatch.delenv("RLROUNDS_MLFLOW_URI")
    tracker = Tracker.connect(settings(), StorageRoot.of(storage), must_exist=True)
    assert tracker.find_model_version("rlrounds-addition", {"run_id": "served", "round": "1"}) == "2"
