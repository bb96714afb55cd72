"""The trajectory store: round trip, content addressing, commit-by-manifest, corruption detection."""

import json
import os
import subprocess
import sys
from datetime import UTC, datetime

import pytest

from storage.paths import StorageRoot
from storage.trajectories import (
    CorruptPartError,
    TrajectoryStoreError,
    find_version,
    list_manifests,
    read_manifest,
    read_table,
    rows_to_table,
    write_version,
)


def make_row(group: int, index: int, reward: float) -> dict:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    return {
        "run_id": "run",
        "round": 1,
        "prompt_id": f"p{group}",
        "group_id": f"g{group}",
        "sample_index": index,
        "task": "addition",
        "prompt_text": "1+2=",
        "prompt_token_ids": [1, 5, 14, 6, 15],
        "reference": "3",
        "completion_text": "3",
        "completion_token_ids": [7, 2],
        "rollout_logprobs": [-0.25, -0.125],
        "token_policy_versions": [0, 0],
        "finish_reason": "stop",
        "engine": {"name": "embedded", "version": "t", "dtype": "float32"},
        "sampling": {"temperature": 1.0, "top_p": 1.0, "seed": 1, "max_tokens": 8},
        "verifier": {"name": "addition", "version": "1"},
        "reward": reward,
        "outcome": "success" if reward else "model_failure",
        "verify_error": None,
        "advantage": 0.5,
        "kept": True,
        "drop_reason": None,
        "enqueued_at": now,
        "started_at": now,
        "finished_at": now,
        "verified_at": now,
        "gen_latency_s": 0.1,
        "verify_latency_s": 0.001,
    }


@pytest.fixture
def root(tmp_path):
    return StorageRoot.of(str(tmp_path / "store"))


def _write(root, rows, meta=None):
    meta = meta or {"kind": "rollout", "run_id": "run", "round": 1, "parent": None, "derivation": {}}
    return write_version(root, lambda v: root.trajectory_version("run", 1, v), rows_to_table(rows), meta)


def test_round_trip_keeps_every_column(root):
    rows = [make_row(g, i, float(i % 2)) for g in range(3) for i in range(4)]
    manifest = _write(root, rows)
    table = read_table(root, read_manifest(root, manifest.directory))
    back = table.to_pylist()
    assert len(back) == 12 and manifest.rows == 12
    assert back[0]["completion_token_ids"] == [7, 2] and back[0]["rollout_logprobs"] == [-0.25, -0.125]
    assert back[0]["engine"]["dtype"] == "float32" and back[0]["sampling"]["seed"] == 1
    assert {r["trajectory_version"] for r in back} == {manifest.version}


def test_a_process_that_read_a_version_exits_cleanly(root):
    """A threaded Parquet read makes pyarrow 25 and 26 abort the process at its exit, often ('terminate called
    without an active exception', exit 134): the store reads single-threaded (``PARQUET_READ_THREADS``)."""
    manifest = _write(root, [make_row(g, i, float(i % 2)) for g in range(50) for i in range(4)])
    script = (
        "import sys\n"
        "from storage.paths import StorageRoot\n"
        "from storage.trajectories import read_manifest, read_table\n"
        "root = StorageRoot.of(sys.argv[1])\n"
        "print(read_table(root, read_manifest(root, sys.argv[2])).num_rows)\n"
    )
    for _ in range(6):  # with threaded reads, about half the exits abort here: six clean ones in a row rule that out
        done = subprocess.run(
            [sys.executable, "-c", script, root.uri, manifest.directory], capture_output=True, text=True, timeout=120
        )
        assert (done.returncode, done.stdout.strip()) == (0, "200"), done.stderr[-2000:]


def test_same_content_same_version_and_listed(root):
    rows = [make_row(0, i, 1.0) for i in range(2)]
    a, b = _write(root, rows), _write(root, rows)
    assert a.version == b.version
    assert [m.version for m in list_manifests(root)] == [a.version]
    assert find_version(root, a.version[:8]).version == a.version
    c = _write(root, rows, {"kind": "rollout", "run_id": "run", "round": 1, "parent": None, "derivation": {"x": 1}})
    assert c.version != a.version  # the derivation is part of the identity


def test_directory_without_manifest_is_invisible(root):
    manifest = _write(root, [make_row(0, 0, 1.0)])
    root.fs.rm(f"{manifest.directory}/manifest.json")
    assert list_manifests(root) == []
    with pytest.raises(TrajectoryStoreError, match="no committed trajectory version"):
        find_version(root, manifest.version)


class Unlisted(StorageRoot):
    """A root that refuses to list: what a lookup by a known place must never need."""

    def glob(self, pattern: str) -> list[str]:
        raise AssertionError(f"listed {pattern}")


def test_a_whole_id_is_read_where_its_round_or_derived_keeps_it_without_listing_the_root(root):
    """A model version's description resolves its trajectory version on every evaluation; a listing of every run's
    rounds grows with the root (on S3, a listing of the whole bucket prefix), so a whole id is looked for at its
    round and under derived/ first."""
    rows = [make_row(0, i, 1.0) for i in range(2)]
    rollout = _write(root, rows)
    meta = {"kind": "filtered", "run_id": "run", "round": 1, "parent": rollout.version, "derivation": {"where": "x"}}
    derived = write_version(root, root.derived_version, rows_to_table(rows), meta)
    unlisted = Unlisted(root.uri)
    assert find_version(unlisted, rollout.version, near=("run", 1)).directory == rollout.directory
    assert find_version(unlisted, derived.version).directory == derived.directory
    with pytest.raises(AssertionError, match="listed"):  # a prefix, or an id kept elsewhere, is still searched for
        find_version(unlisted, rollout.version[:8], near=("run", 1))
    assert find_version(root, rollout.version, near=("other-run", 3)).directory == rollout.directory
    root.fs.rm(f"{rollout.directory}/manifest.json")  # uncommitted: invisible, however it is looked for
    with pytest.raises(TrajectoryStoreError, match="no committed trajectory version"):
        find_version(root, rollout.version, near=("run", 1))


def test_flipped_byte_is_reported_with_file_and_version(root):
    manifest = _write(root, [make_row(0, i, 1.0) for i in range(4)])
    part = f"{manifest.directory}/part-00000.parquet"
    data = bytearray(open(part, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(part, "wb").write(bytes(data))
    with pytest.raises(CorruptPartError, match=rf"{manifest.version}.*part-00000.parquet.*corrupted"):
        read_table(root, read_manifest(root, manifest.directory))


def test_unknown_schema_major_is_refused(root):
    manifest = _write(root, [make_row(0, 0, 1.0)])
    path = f"{manifest.directory}/manifest.json"
    body = json.load(open(path))
    body["schema_version"] = "2.0"
    json.dump(body, open(path, "w"))
    with pytest.raises(TrajectoryStoreError, match="schema version 2.0"):
        read_manifest(root, manifest.directory)


def test_torn_manifest_is_reported_with_file_and_version(root):
    manifest = _write(root, [make_row(0, 0, 1.0)])
    path = f"{manifest.directory}/manifest.json"
    text = open(path).read()
    open(path, "w").write(text[: len(text) // 2])
    with pytest.raises(CorruptPartError, match=rf"{manifest.version}: manifest {path} is not valid JSON"):
        read_manifest(root, manifest.directory)
    assert sorted(os.listdir(manifest.directory)) == ["manifest.json", "part-00000.parquet"]  # no .partial left behind
