"""A campaign attached to a Ray cluster it did not start: `ray start --head` on loopback, then
`rlrounds run --replicas 2 --ray-address HOST:PORT` with train.workers 2, as a user with a cluster runs
it. The cluster's own record (its GCS) shows the engine replicas and the trainer's workers ran there as
actors; the rollout's verifier calls run there as Ray tasks (a verifier the cluster could not run would
fail the round as infrastructure failures). The cluster is stopped at the end.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACTOR_CLASSES = """
import json, sys, ray
from ray._private.state import actors
ray.init(address=sys.argv[1], log_to_driver=False)
print(json.dumps([(a["ActorClassName"], a["State"]) for a in actors().values()]))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop_cluster(temp: str) -> None:
    """Stop this cluster's processes only: each names its session directory under ``temp`` on its
    command line (`ray stop` would stop every Ray on the machine)."""
    import signal
    import time

    def ours() -> list[int]:
        """Processes naming ``temp``, and their descendants: Ray's agents retitle themselves
        (`ray::DashboardAgent`), so only their parentage says whose they are."""
        named, parent = set(), {}
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if temp.encode() in f.read():
                        named.add(int(entry))
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
        found, grew = set(named), True
        while grew:
            children = {pid for pid, ppid in parent.items() if ppid in found} - found
            found |= children
            grew = bool(children)
        return sorted(found)

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in ours():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        while ours() and time.monotonic() < deadline:
            time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster():
    """A one-node cluster on loopback whose workers import this checkout (PYTHONPATH), as every node
    of a real cluster must have the code installed. 127.0.0.2, not 127.0.0.1: Ray rewrites an address
    of 127.0.0.1 to the machine's outward IP, where a loopback-bound cluster does not listen."""
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="rl-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    # the cluster and every process joining it share a token, as the nodes of a real cluster do
    env = {
        **os.environ,
        "PYTHONPATH": REPO,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
    }
    started = subprocess.run(
        [
            ray_cli,
            "start",
            "--head",
            "--node-ip-address=127.0.0.2",
            f"--port={port}",
            "--num-cpus=4",  # 2 engine replicas and 2 trainer workers
            "--include-dashboard=false",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    try:
        yield {"address": f"127.0.0.2:{port}", "env": env}
    finally:
        _stop_cluster(temp)
        shutil.rmtree(temp, ignore_errors=True)


def test_a_campaign_runs_its_replicas_on_an_existing_cluster(cluster, tmp_path, seed_builtin_base):
    storage = str(tmp_path / "data")
    seed_builtin_base(storage)
    config = tmp_path / "campaign.json"
    config.write_text(
        json.dumps(
            {
                "rounds": 1,
                "run_id": "cluster",
                "round": {
                    "rollout": {"max_batch": 64},
                    "verify": {"on_ray": True},
                    "train": {"groups_per_step": 2, "steps_per_round": 2, "workers": 2},
                    "publish": {"model_name": "cluster-policy"},
                },
            }
        )
    )
    env = {**cluster["env"], "RLROUNDS_STORAGE": storage}
    env.pop("PREFECT_API_URL", None)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            "--config",
            str(config),
            "--storage",
            storage,
            "--replicas",
            "2",
            "--ray-address",
            cluster["address"],
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "campaign cluster: held-out accuracy" in run.stdout
    # the cluster's own record of the actors it ran, read by a client with the token (Ray reads the
    # token when it is imported, so in a process of its own)
    listed = subprocess.run(
        [sys.executable, "-c", ACTOR_CLASSES, cluster["address"]],
        env=cluster["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert listed.returncode == 0, listed.stderr[-3000:]
    every = json.loads(listed.stdout.strip().splitlines()[-1])
    replicas = [(name, state) for name, state in every if "EngineReplica" in name]
    assert len(replicas) >= 2, every  # the campaign's two engine replicas ran on this cluster
    assert all(state == "DEAD" for _, state in replicas), replicas  # released when the campaign ended
    workers = [(name, state) for name, state in every if "TrainWorker" in name]
    assert len(workers) == 2 and all(state == "DEAD" for _, state in workers), every  # the trainer's group too
