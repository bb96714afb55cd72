"""A killed campaign leaves no process behind: the next `rlrounds` start stops what it left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from flows.orphans import OWNER_VAR, orphans, reap_orphans
from storage.campaigns import process_started

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


def _gone_owner() -> str:
    """The identity of an rlrounds process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    started = process_started(proc.pid)
    proc.wait()
    return f"{proc.pid}:{started}"


def _spawn(owner: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != OWNER_VAR}
    if owner is not None:
        env[OWNER_VAR] = owner
    return subprocess.Popen(SLEEPER, env=env)


def test_only_processes_of_a_gone_owner_are_reaped():
    orphan = _spawn(_gone_owner())  # marked by an rlrounds process that died
    live = _spawn(f"{os.getppid()}:{process_started(os.getppid())}")  # marked by one that still runs
    reused = _spawn(f"{os.getppid()}:1")  # its owner's pid now belongs to another process
    unmarked = _spawn(None)  # nothing to do with rlrounds
    try:
        time.sleep(0.2)
        found = set(orphans())
        assert orphan.pid in found and reused.pid in found
        assert live.pid not in found and unmarked.pid not in found
        assert {orphan.pid, reused.pid} <= set(reap_orphans(grace_s=2))
        assert orphan.wait(timeout=10) == -signal.SIGTERM
        assert reused.wait(timeout=10) == -signal.SIGTERM
        assert live.poll() is None and unmarked.poll() is None
    finally:
        for p in (orphan, live, reused, unmarked):
            p.kill()
            p.wait()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _server_children(pid: int) -> list[int]:
    found = []
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"prefect.server.api.server:create_app" in f.read():
                    found.append(child)
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_sigkilled_campaign_leaves_nothing_after_the_next_start(tmp_path, seed_builtin_base):
    """`rlrounds run` without a Prefect server starts Prefect's ephemeral API server; SIGKILL the campaign
    once it has, and that server is orphaned; the next `rlrounds` command stops it."""
    storage = str(tmp_path / "data")
    seed_builtin_base(storage)
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", OWNER_VAR)}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
    cli = [sys.executable, "-m", "flows.cli"]
    campaign = subprocess.Popen(  # rounds enough to outlast the waits below on a fast machine: it is killed anyway
        [*cli, "run", "--storage", storage, "--rounds", "45"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    servers: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not servers and time.monotonic() < deadline and campaign.poll() is None:
            time.sleep(0.5)
            servers = _server_children(campaign.pid)
        assert servers, "the campaign never started Prefect's ephemeral server"
        time.sleep(15)  # past its start-up: a server that lost its port race exits and is replaced
        servers = _server_children(campaign.pid)
        assert servers, "the campaign's ephemeral server did not stay up"
        campaign.kill()
        campaign.wait()
        time.sleep(1)
        assert all(process_started(s) is not None for s in servers)  # orphaned: still running without its parent
        done = subprocess.run([*cli, "config"], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "left by a killed rlrounds" in done.stderr
        deadline = time.monotonic() + 10
        while any(process_started(s) is not None for s in servers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(process_started(s) is None for s in servers)
    finally:
        campaign.kill()
        for s in servers:
            try:
                os.kill(s, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _marked_by(pid: int) -> list[int]:
    """Processes carrying ``pid``'s rlrounds marking: what that process started, however deep."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if f"{OWNER_VAR}={pid}:".encode() in f.read():
                    found.append(int(name))
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_sigtermed_campaign_stops_everything_it_started(tmp_path, seed_builtin_base):
    """SIGTERM a campaign once its ephemeral Prefect server is up: it exits 143 and no process it
    started is left running, without waiting for the next `rlrounds` start to reap them."""
    storage = str(tmp_path / "data")
    seed_builtin_base(storage)
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", OWNER_VAR)}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
    campaign = subprocess.Popen(  # rounds enough to outlast the wait below on a fast machine: it is stopped anyway
        [sys.executable, "-m", "flows.cli", "run", "--storage", storage, "--rounds", "45"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    started: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not _server_children(campaign.pid) and time.monotonic() < deadline and campaign.poll() is None:
            time.sleep(0.5)
        assert _server_children(campaign.pid), "the campaign never started Prefect's ephemeral server"
        time.sleep(15)  # into its flow run, past the server's start-up
        started = _marked_by(campaign.pid)
        assert started, "the campaign marked none of the processes it started"
        campaign.send_signal(signal.SIGTERM)
        _, err = campaign.communicate(timeout=120)
        assert campaign.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
        assert "terminated" in err.decode()
        assert [pid for pid in started if process_started(pid) is not None] == []
        assert _marked_by(campaign.pid) == []
    finally:
        campaign.kill()
        for pid in _marked_by(campaign.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
