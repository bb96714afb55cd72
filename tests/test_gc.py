"""Garbage collection: a writer killed between its parts and its manifest leaves a version nobody can see,
and `rlrounds gc` removes it; committed versions and checkpoints are never touched."""

import os
import signal
import subprocess
import sys
import time

import pytest
from test_store import make_row

from flows.cli import main
from storage import checkpoints
from storage.gc import collect, find_leftovers
from storage.paths import StorageRoot
from storage.trajectories import (
    TrajectoryStoreError,
    find_version,
    list_manifests,
    read_table,
    rows_to_table,
    write_version,
)

# A real writer process. The commit step is replaced by a stall, so the parent can SIGKILL it at the
# exact point a crash hurts most: every part on disk, no manifest yet.
WRITER = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
import storage.trajectories as store
from storage.paths import StorageRoot
from test_store import make_row

def stall(*args, **kwargs):
    print("parts written", flush=True)
    time.sleep(600)

store._commit_manifest = stall
root = StorageRoot.of(sys.argv[1])
rows = [make_row(g, i, float(i % 2)) for g in range(3) for i in range(4)]
meta = {"kind": "rollout", "run_id": "run", "round": 1, "parent": None, "derivation": {"writer": "killed"}}
store.write_version(root, lambda v: root.trajectory_version("run", 1, v), store.rows_to_table(rows), meta)
print("committed", flush=True)
"""


def _commit(root, marker: str):
    rows = [make_row(0, i, float(i % 2)) for i in range(4)]
    meta = {"kind": "rollout", "run_id": "run", "round": 1, "parent": None, "derivation": {"marker": marker}}
    return write_version(root, lambda v: root.trajectory_version("run", 1, v), rows_to_table(rows), meta)


def _age(path: str, seconds: float) -> None:
    """Make every file under ``path`` (and the directories) look ``seconds`` old."""
    then = time.time() - seconds
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            os.utime(os.path.join(dirpath, name), (then, then))
        os.utime(dirpath, (then, then))


@pytest.fixture
def root(tmp_path):
    return StorageRoot.of(str(tmp_path / "store"))


def test_writer_killed_before_manifest_leaves_invisible_version_that_gc_removes(root, capsys):
    committed = _commit(root, "survivor")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, root.uri, os.path.dirname(__file__)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = writer.stdout.readline()
        assert line.strip() == "parts written", writer.stderr.read()
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(timeout=30) == -signal.SIGKILL
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    trajectories_dir = root.round_trajectories("run", 1)
    dirs = sorted(os.listdir(trajectories_dir))
    orphan = os.path.join(trajectories_dir, next(d for d in dirs if d != committed.version))
    assert os.listdir(orphan) == ["part-00000.parquet"]  # parts made it, the manifest did not

    # Invisible: readers list and resolve only committed versions.
    assert [m.version for m in list_manifests(root)] == [committed.version]
    with pytest.raises(TrajectoryStoreError, match="no committed trajectory version"):
        find_version(root, os.path.basename(orphan))

    # Within the grace period a leftover might still be a live writer: left alone.
    assert main(["gc", "--storage", root.uri]) == 0
    assert os.path.isdir(orphan)
    assert main(["gc", "--storage", root.uri, "--grace", "0", "--dry-run"]) == 0
    assert os.path.isdir(orphan) and f"would remove trajectories {orphan}" in capsys.readouterr().out

    assert main(["gc", "--storage", root.uri, "--grace", "0"]) == 0
    out = capsys.readouterr().out
    assert not os.path.exists(orphan) and f"removed trajectories {orphan}" in out and "removed 1 uncommitted" in out
    assert read_table(root, find_version(root, committed.version)).num_rows == 4  # the committed version is intact


def test_gc_finds_each_kind_of_leftover_and_never_a_committed_one(root, tmp_path):
    committed = _commit(root, "committed")
    local = tmp_path / "ckpt"
    local.mkdir()
    (local / "model.safetensors").write_bytes(b"weights")
    # committed checkpoint, interrupted checkpoint copy, a round's staging, a derived version without manifest
    checkpoints.commit_checkpoint(root, str(local), root.checkpoint("run", 1), {"kind": "round"})
    half = root.checkpoint("run", 2)
    os.makedirs(half)
    (local / "model.safetensors").rename(os.path.join(half, "model.safetensors"))
    staging = root.staging("run", 3)
    os.makedirs(staging)
    open(root.rollout_staging_file("run", 3), "wb").write(b"PAR1")
    derived = root.derived_version("0123456789abcdef0123")
    os.makedirs(derived)
    open(os.path.join(derived, "part-00000.parquet"), "wb").write(b"PAR1")
    for path in (half, staging, derived, committed.directory, root.checkpoint("run", 1)):
        _age(path, 7200)
    fresh = root.derived_version("fedcba9876543210fedc")
    os.makedirs(fresh)
    open(os.path.join(fresh, "part-00000.parquet"), "wb").write(b"PAR1")

    # a round whose rollout is recorded done but not yet filtered: a resume will read its staging
    awaited = root.staging("run", 4)
    os.makedirs(awaited)
    open(root.rollout_staging_file("run", 4), "wb").write(b"PAR1")
    os.makedirs(os.path.dirname(root.stage_record("run", 4, "rollout")))
    open(root.stage_record("run", 4, "rollout"), "w").write("{}")
    _age(awaited, 7200)

    found = {(leftover.kind, leftover.path) for leftover in find_leftovers(root, grace_s=3600)}
    assert found == {("checkpoint", half), ("staging", staging), ("trajectories", derived)}  # not the fresh one

    removed = collect(root, grace_s=3600)
    assert {leftover.path for leftover in removed} == {half, staging, derived}
    assert os.path.isdir(fresh) and os.path.isdir(awaited) and checkpoints.is_committed(root, root.checkpoint("run", 1))
    assert [m.version for m in list_manifests(root)] == [committed.version]
    assert collect(root, grace_s=0, dry_run=True)[0].path == fresh  # only the fresh leftover remains
