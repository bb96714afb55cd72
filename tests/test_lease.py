"""The lease that serialises short read-compare-write steps between processes on one storage root (the
champion gate, the base build): racing processes incrementing one counter lose no update, locally and on
S3; a dead holder's lease expires, or is broken at once when it was taken on this host by a process that
is gone; a live one is waited for, then reported; two campaigns' base preparations build the base once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from storage.files import LeaseTimeout, lease
from storage.paths import StorageRoot

# Each process adds 1 to a counter file N times, reading and writing it inside the lease; the sleep
# between read and write is the window two unserialised writers would both fall into.
INCREMENT = """
import sys, time
from storage.files import lease
from storage.paths import StorageRoot
root = StorageRoot.of(sys.argv[1])
counter, lock = root.join("counter"), root.join("locks", "counter.lock")
for _ in range(int(sys.argv[2])):
    with lease(root, lock, poll_s=0.01):
        value = int(root.fs.cat_file(counter))
        time.sleep(0.01)
        root.fs.pipe_file(counter, str(value + 1).encode())
"""


def _race(root: StorageRoot, processes: int = 3, each: int = 8) -> int:
    root.fs.makedirs(root.join("locks"), exist_ok=True)
    root.fs.pipe_file(root.join("counter"), b"0")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    procs = [
        subprocess.Popen([sys.executable, "-c", INCREMENT, root.uri, str(each)], env=env, stderr=subprocess.PIPE)
        for _ in range(processes)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    assert not root.fs.exists(root.join("locks", "counter.lock"))  # released on the way out
    return int(StorageRoot.of(root.uri).fs.cat_file(root.join("counter")))


def test_racing_processes_lose_no_update_on_a_local_root(tmp_path):
    assert _race(StorageRoot.of(str(tmp_path / "root"))) == 3 * 8


@pytest.mark.s3
def test_racing_processes_lose_no_update_on_s3(s3_endpoint):
    assert _race(StorageRoot.of("s3://rlrounds-test/lease-race")) == 3 * 8


def test_a_dead_holders_lease_expires_and_a_live_one_is_waited_for(tmp_path):
    root = StorageRoot.of(str(tmp_path / "root"))
    path = root.join("locks", "x.lock")
    root.fs.makedirs(root.join("locks"), exist_ok=True)
    root.fs.pipe_file(path, json.dumps({"token": "dead", "pid": 1, "host": "h", "at": time.time() - 1000}).encode())
    with lease(root, path, ttl_s=60):  # older than the TTL: broken and taken
        assert json.loads(root.fs.cat_file(path))["token"] != "dead"
    assert not root.fs.exists(path)
    root.fs.pipe_file(path, json.dumps({"token": "live", "pid": 7, "host": "h", "at": time.time()}).encode())
    with pytest.raises(LeaseTimeout, match="held by pid 7"):
        with lease(root, path, ttl_s=60, wait_s=0.3, poll_s=0.05):
            pass
    assert json.loads(root.fs.cat_file(path))["token"] == "live"  # a lease not taken is never removed


def test_a_lease_of_a_gone_process_on_this_host_is_broken_at_once(tmp_path):
    root = StorageRoot.of(str(tmp_path / "root"))
    path = root.join("locks", "x.lock")
    root.fs.makedirs(root.join("locks"), exist_ok=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    here = socket.gethostname()
    root.fs.pipe_file(path, json.dumps({"token": "gone", "pid": gone.pid, "host": here, "at": time.time()}).encode())
    with lease(root, path, ttl_s=3600, wait_s=5):  # fresh, but its holder is gone: broken, not waited out
        assert json.loads(root.fs.cat_file(path))["token"] != "gone"
    # a live holder on this host (this test's parent, pytest's own process group leader) is waited for
    root.fs.pipe_file(
        path, json.dumps({"token": "live", "pid": os.getppid(), "host": here, "at": time.time()}).encode()
    )
    with pytest.raises(LeaseTimeout, match="held by pid"):
        with lease(root, path, ttl_s=3600, wait_s=0.3, poll_s=0.05):
            pass


PREPARE = """
import json, sys
from tasks.campaign.base_policy import run_prepare_base
built = run_prepare_base(storage=sys.argv[1], base_model="builtin", progress=lambda message: None)
print(json.dumps({"built": built.built, "checkpoint": built.checkpoint}))
"""


@pytest.mark.slow
def test_two_campaigns_on_a_fresh_root_build_the_base_once(tmp_path):
    storage = str(tmp_path / "root")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PREPARE, storage], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err.decode()[-2000:]
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    assert sorted(r["built"] for r in results) == [False, True]  # one built it, the other waited and found it
    assert results[0]["checkpoint"] == results[1]["checkpoint"]
    root = StorageRoot.of(storage)
    assert not root.fs.exists(root.lock("base-" + os.path.basename(results[0]["checkpoint"])))
