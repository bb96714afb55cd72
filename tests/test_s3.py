"""A storage root on S3 (a local moto server started by the session, spoken to over HTTP through s3fs
and boto3; nothing is patched): the store, its corruption checks, retries of transient errors, gc,
and a whole campaign followed by refilter, replay and a lineage audit."""

import http.client
import http.server
import json
import os
import threading
import uuid

import pytest
from test_store import make_row

from flows.cli import main
from storage.paths import StorageRoot, child
from storage.trajectories import (
    CorruptPartError,
    find_version,
    list_manifests,
    read_table,
    rows_to_table,
    write_version,
)

pytestmark = pytest.mark.s3


def _root(prefix: str) -> StorageRoot:
    return StorageRoot.of(f"s3://rlrounds-test/{prefix}-{uuid.uuid4().hex[:8]}")


def _write(root: StorageRoot, marker: str = "s3"):
    rows = [make_row(g, i, float(i % 2)) for g in range(2) for i in range(4)]
    meta = {"kind": "rollout", "run_id": "run", "round": 1, "parent": None, "derivation": {"marker": marker}}
    return write_version(root, lambda v: root.trajectory_version("run", 1, v), rows_to_table(rows), meta)


def test_store_round_trip_and_corruption_on_s3(s3_endpoint):
    root = _root("store")
    manifest = _write(root)
    assert manifest.directory.startswith("s3://rlrounds-test/")
    assert [m.version for m in list_manifests(root)] == [manifest.version]
    assert read_table(root, find_version(root, manifest.version[:8])).num_rows == 8

    part = child(manifest.directory, "part-00000.parquet")
    data = bytearray(root.fs.cat_file(part))
    data[len(data) // 2] ^= 0xFF
    root.fs.pipe_file(part, bytes(data))
    with pytest.raises(CorruptPartError, match=rf"{manifest.version}: part {part} is corrupted"):
        read_table(root, find_version(root, manifest.version))
    root.fs.rm(part)
    with pytest.raises(CorruptPartError, match=rf"{manifest.version}: part {part} is missing"):
        read_table(root, find_version(root, manifest.version))


def test_gc_on_s3_removes_parts_without_manifest_and_keeps_committed(s3_endpoint, capsys):
    root = _root("gc")
    committed = _write(root, "committed")
    orphan = root.trajectory_version("run", 1, "0123456789abcdef0123")
    root.fs.pipe_file(child(orphan, "part-00000.parquet"), b"PAR1")
    assert [m.version for m in list_manifests(root)] == [committed.version]
    assert main(["gc", "--storage", root.uri]) == 0 and root.fs.exists(orphan)  # within the default grace
    assert main(["gc", "--grace", "0", "--storage", root.uri]) == 0
    assert f"removed trajectories {orphan}" in capsys.readouterr().out
    assert not root.fs.exists(child(orphan, "part-00000.parquet"))
    assert read_table(root, find_version(StorageRoot.of(root.uri), committed.version)).num_rows == 8


class _FlakyProxy(http.server.BaseHTTPRequestHandler):
    """Forwards to the moto server, answering every third request (four times in all) with 503 SlowDown."""

    protocol_version = "HTTP/1.1"  # keep-alive and `Expect: 100-continue`, as S3 clients expect
    upstream: tuple[str, int]
    count = 0
    failed = 0
    lock = threading.Lock()

    def _handle(self) -> None:
        with self.lock:
            type(self).count += 1
            fail = self.count % 3 == 1 and self.failed < 4
            type(self).failed += fail
        body = self._body()
        if fail:
            error = (
                b"<?xml version='1.0'?><Error><Code>SlowDown</Code>"
                b"<Message>Please reduce your request rate.</Message></Error>"
            )
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(error)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(error)
            return
        headers = {
            k: v
            for k, v in self.headers.items()
            if k.lower() not in ("connection", "transfer-encoding", "content-length", "expect")
        }
        headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        conn.request(self.command, self.path, body=body, headers=headers)
        response = conn.getresponse()
        payload = response.read()
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("connection", "transfer-encoding", "content-length", "server", "date"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)
        conn.close()

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

    def log_message(self, *args) -> None:
        pass


def test_transient_s3_errors_are_retried(s3_endpoint, monkeypatch):
    host, port = s3_endpoint.removeprefix("http://").split(":")
    _FlakyProxy.upstream = (host, int(port))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FlakyProxy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.setenv("RLROUNDS_S3_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        root = _root("flaky")  # a fresh root: its filesystem talks to the proxy
        manifest = _write(root)
        assert read_table(root, find_version(root, manifest.version)).num_rows == 8
        assert [m.version for m in list_manifests(root)] == [manifest.version]
        assert _FlakyProxy.failed == 4  # writes, listings and reads met 503s and went through anyway
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_campaign_refilter_replay_and_lineage_on_s3(s3_endpoint, prefect_harness, seed_builtin_base, capsys):
    from safetensors.torch import load as load_safetensors

    from flows.campaign import rl_campaign
    from flows.config import CampaignConfig, ReplayRequest
    from flows.replay import rl_replay
    from storage import checkpoints

    config = {
        "rounds": 2,
        "run_id": "s3-tiny",
        "round": {"train": {"groups_per_step": 2, "steps_per_round": 2}, "publish": {"model_name": "s3-policy"}},
    }
    root = _root("campaign")
    seed_builtin_base(root.uri)  # the base-policy cache, on S3
    result = rl_campaign(CampaignConfig.model_validate(config), storage=root.uri)
    rounds = result["rounds"]

    # trajectories, checkpoints and MLflow artifacts all live under the S3 root
    assert sorted(m.version for m in list_manifests(root)) == sorted(r["trajectory_version"] for r in rounds[1:])
    for k in (1, 2):
        assert checkpoints.is_committed(root, root.checkpoint("s3-tiny", k))
        assert root.fs.exists(child(root.checkpoint("s3-tiny", k), "model.safetensors"))
    assert root.fs.glob(root.mlflow_artifacts().removeprefix("s3://") + "/**/round_health_report.md")

    # refilter: a derived version under <root>/derived/
    capsys.readouterr()  # the campaign's own progress lines
    assert (
        main(
            [
                "refilter",
                rounds[2]["trajectory_version"],
                "--where",
                "outcome <> 'infra_failure'",
                "--regroup",
                "--storage",
                root.uri,
            ]
        )
        == 0
    )
    derived = capsys.readouterr().out.split()[2]
    assert find_version(root, derived).directory == root.derived_version(derived)

    # replay round 2 from round 1's model version: the same weights, byte for byte
    round_config = CampaignConfig.model_validate(config).round
    replay = rl_replay(
        ReplayRequest(
            trajectories=rounds[2]["trajectory_version"],
            from_model=rounds[1]["model_version"],
            config=round_config,
            evaluate=False,
        ),
        storage=root.uri,
    )
    assert replay["checkpoint"] == root.replay_checkpoint(replay["replay_id"])
    original = root.fs.cat_file(child(root.checkpoint("s3-tiny", 2), "model.safetensors"))
    replayed = root.fs.cat_file(child(replay["checkpoint"], "model.safetensors"))
    assert original == replayed
    a, b = load_safetensors(original), load_safetensors(replayed)
    assert all(a[k].equal(b[k]) for k in a)

    # lineage from the registry and the manifests on S3
    assert main(["lineage", rounds[2]["model_version"], "--json", "--storage", root.uri]) == 0
    steps = json.loads(capsys.readouterr().out)
    assert [s["round"] for s in steps] == ["2", "1", "0"]
    assert all(s["checkpoint"].startswith(root.uri) for s in steps)
    assert [s["derivation"][0]["uri"] for s in steps[:2]] == [
        root.trajectory_version("s3-tiny", k, rounds[k]["trajectory_version"]) for k in (2, 1)
    ]
    assert os.environ["MLFLOW_S3_ENDPOINT_URL"] == s3_endpoint


RACE_CLAIMS = """
import sys
from storage.campaigns import CampaignError, claim
from storage.paths import StorageRoot

root = StorageRoot.of(sys.argv[1])
for k in range(int(sys.argv[2])):
    try:
        claim(root, f"race-{k}", {"writer": sys.argv[3]}, {"seed": 0}, "new")
        print(k, flush=True)
    except CampaignError:
        pass
"""


def test_owner_lock_is_exclusive_between_racing_writers_on_s3(s3_endpoint, tmp_path):
    """Two processes claim the same 12 run ids at once on one S3 root: every id gets exactly one owner,
    and the stored record is the winner's (S3's conditional put decides, not a check then a write)."""
    import subprocess
    import sys

    root = _root("race")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")]),
    }
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", RACE_CLAIMS, root.uri, "12", name],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    ]
    won = {}
    for name, writer in zip(("a", "b"), writers):
        out, err = writer.communicate(timeout=300)
        assert writer.returncode == 0, err[-2000:]
        won[name] = {int(k) for k in out.split()}
    assert won["a"] | won["b"] == set(range(12))  # every run id has an owner
    assert not won["a"] & won["b"]  # and never two
    from storage.campaigns import read_campaign

    fresh = StorageRoot.of(root.uri)
    for name, ids in won.items():
        for k in ids:
            assert read_campaign(fresh, f"race-{k}")["config"] == {"writer": name}


def test_a_checkpoint_with_nested_files_commits_and_copies_back_whole(s3_endpoint, tmp_path):
    """A worker group's checkpoint keeps its optimizer shards in a folder: committing it to S3 and copying
    it back brings every nested file, byte for byte."""
    from storage import checkpoints

    root = _root("nested")
    files = {"config.json": b"{}", "optimizer/.metadata": b"meta", "optimizer/__0_0.distcp": b"\x00\x01"}
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    target = checkpoints.commit_checkpoint(root, str(tmp_path), root.checkpoint("nested", 1), {"kind": "round"})
    local = checkpoints.local_copy(root, target)
    for name, data in files.items():
        with open(os.path.join(local, name), "rb") as f:
            assert f.read() == data, name
