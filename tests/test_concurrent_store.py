"""Many processes opening one new MLflow store at once: each succeeds or fails for its own reasons only.

MLflow creates and migrates a SQLite store on first use; before the store was opened under a lock, two
campaigns started together on a new storage root failed with "table ... already exists".
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

OPEN_AND_WRITE = """
import sys
from storage.tracking import Tracker
from storage.paths import StorageRoot
from storage.settings import settings

tracker = Tracker.connect(settings(), StorageRoot.of(sys.argv[1]))
experiment = tracker.experiment_id("campaign-" + sys.argv[2])
run = tracker.ensure_run(experiment, "round-1", {"writer": sys.argv[2]})
tracker.log(run, metrics={"eval/accuracy": 0.5})
tracker.finish(run)
print("done", sys.argv[2])
"""


@pytest.mark.slow
def test_processes_open_a_new_store_together(tmp_path):
    root = str(tmp_path / "root")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")]),
    }
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", OPEN_AND_WRITE, root, str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    results = [(w.wait(timeout=300), *w.communicate()) for w in writers]
    for i, (code, out, err) in enumerate(results):
        assert code == 0, f"writer {i} failed:\n{err[-2000:]}"
        assert out.strip() == f"done {i}"

    from storage.paths import StorageRoot
    from storage.settings import settings
    from storage.tracking import Tracker

    tracker = Tracker.connect(settings(), StorageRoot.of(root), must_exist=True)
    names = {e.name for e in tracker.client.search_experiments()}
    assert {f"campaign-{i}" for i in range(4)} <= names  # every writer's work is in the one store
