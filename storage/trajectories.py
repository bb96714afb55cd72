"""The trajectory store: Parquet parts plus a manifest, written last, that commits them.

A trajectory version is immutable and content-addressed: its id is a hash of the manifest body,
which lists every part's sha256 and row count, the schema version, the version's parent and how it
was derived. Parts are written first; the manifest is the commit. Readers trust only versions with a
manifest and verify every part's sha256 before parsing it.

A round's version may carry attachments, files listed in the manifest with their sha256 and so
committed with it: ``carryover.parquet`` holds the round's unfinished samples (partial rollouts and
samples still waiting on the environment), which the next round resumes. They are not rows of the
version (nothing trains on them there); ``read_carryover`` reads them, verified like a part.

Rows do not store their own ``trajectory_version`` (the id is a hash over the parts, so a part
cannot contain it); readers attach it as a column from the manifest.
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from storage.files import write_atomic
from storage.paths import CARRYOVER, MANIFEST, StorageRoot, child, manifest_of, part_name

SCHEMA_VERSION = "1.1"  # 1.1: prompt_weight
ROWS_PER_PART = 50_000


class TrajectoryStoreError(RuntimeError):
    pass


class CorruptPartError(TrajectoryStoreError):
    pass


def arrow_schema():
    ts = pa.timestamp("us", tz="UTC")
    return pa.schema(
        [
            ("schema_version", pa.string()),
            # identity
            ("run_id", pa.string()),
            ("round", pa.int32()),
            ("prompt_id", pa.string()),
            ("group_id", pa.string()),
            ("sample_index", pa.int32()),
            # prompt
            ("task", pa.string()),
            ("prompt_text", pa.string()),
            ("prompt_token_ids", pa.list_(pa.int32())),
            ("reference", pa.string()),
            ("prompt_weight", pa.float64()),  # probability the curriculum drew the prompt with (null before 1.1)
            # completion
            ("completion_text", pa.string()),
            ("completion_token_ids", pa.list_(pa.int32())),
            ("rollout_logprobs", pa.list_(pa.float32())),
            ("token_policy_versions", pa.list_(pa.int32())),
            ("finish_reason", pa.string()),
            ("engine", pa.struct([("name", pa.string()), ("version", pa.string()), ("dtype", pa.string())])),
            (
                "sampling",
                pa.struct(
                    [
                        ("temperature", pa.float64()),
                        ("top_p", pa.float64()),
                        ("seed", pa.int64()),
                        ("max_tokens", pa.int32()),
                    ]
                ),
            ),
            # verification
            ("verifier", pa.struct([("name", pa.string()), ("version", pa.string())])),
            ("reward", pa.float64()),
            ("outcome", pa.string()),
            ("verify_error", pa.string()),
            # filtering
            ("advantage", pa.float64()),
            ("kept", pa.bool_()),
            ("drop_reason", pa.string()),
            # timing
            ("enqueued_at", ts),
            ("started_at", ts),
            ("finished_at", ts),
            ("verified_at", ts),
            ("gen_latency_s", pa.float64()),
            ("verify_latency_s", pa.float64()),
        ]
    )


def carry_schema():
    """A carry-over row: a trajectory row plus its state (partial | unverified | verified)."""
    return arrow_schema().append(pa.field("carry_state", pa.string()))


def carry_table(rows: list[dict]):
    return pa.Table.from_pylist([{**r, "schema_version": SCHEMA_VERSION} for r in rows], schema=carry_schema())


def check_schema_version(found: str, where: str) -> None:
    major = str(found).split(".")[0]
    if major != SCHEMA_VERSION.split(".")[0]:
        raise TrajectoryStoreError(
            f"{where} has schema version {found}, this rlrounds reads major version {SCHEMA_VERSION.split('.')[0]}; "
            "upgrade rlrounds or export the data with the version that wrote it"
        )


def rows_to_table(rows: list[dict]):
    return pa.Table.from_pylist([{**r, "schema_version": SCHEMA_VERSION} for r in rows], schema=arrow_schema())


def table_bytes(table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def version_id(body: dict) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()[:20]


@dataclass
class Manifest:
    version: str
    directory: str
    body: dict = field(repr=False)

    @property
    def parts(self) -> list[dict]:
        return self.body["parts"]

    @property
    def rows(self) -> int:
        return sum(p["rows"] for p in self.parts)

    @property
    def parent(self) -> str | None:
        return self.body.get("parent")

    @property
    def kind(self) -> str:
        return self.body.get("kind", "?")

    @property
    def derivation(self) -> dict:
        return self.body.get("derivation") or {}


def write_version(
    root: StorageRoot, directory_for, table, meta: dict[str, Any], attachments: dict[str, bytes] | None = None
) -> Manifest:
    """Commit ``table`` as a new version. ``directory_for(version) -> URI`` places it.

    meta: run_id, round, kind, parent, derivation ... (anything JSON). ``attachments``: name -> bytes,
    files written beside the parts and listed (sha256) in the manifest, so committed with them.
    Idempotent: writing the same rows with the same meta again yields the same version id and
    rewrites nothing.
    """
    table = table.replace_schema_metadata(None)
    parts = []
    blobs = []
    for i, start in enumerate(range(0, max(table.num_rows, 1), ROWS_PER_PART)):
        blob = table_bytes(table.slice(start, ROWS_PER_PART))
        blobs.append(blob)
        parts.append(
            {
                "path": part_name(i),
                "sha256": sha256(blob),
                "rows": min(ROWS_PER_PART, table.num_rows - start),
                "bytes": len(blob),
            }
        )
    body = {"schema_version": SCHEMA_VERSION, "parts": parts, **meta}
    if attachments:
        body["attachments"] = {
            name: {"sha256": sha256(blob), "bytes": len(blob)} for name, blob in sorted(attachments.items())
        }
    version = version_id(body)
    directory = directory_for(version)
    fs = root.fs
    if fs.exists(manifest_of(directory)):
        return Manifest(version, directory, body)
    fs.makedirs(directory, exist_ok=True)
    for part, blob in zip(parts, blobs):
        with fs.open(child(directory, part["path"]), "wb") as f:
            f.write(blob)
    for name, blob in (attachments or {}).items():
        with fs.open(child(directory, name), "wb") as f:
            f.write(blob)
    _commit_manifest(root, directory, {"version": version, **body})
    return Manifest(version, directory, body)


def _commit_manifest(root: StorageRoot, directory: str, body: dict) -> None:
    """The commit: manifest.json appears whole or not at all (storage/files.py)."""
    write_atomic(root, manifest_of(directory), json.dumps(body, indent=2, sort_keys=True).encode())


def read_manifest(root: StorageRoot, directory: str) -> Manifest:
    path = manifest_of(directory)
    try:
        with root.fs.open(path, "r") as f:
            body = json.load(f)
    except FileNotFoundError:
        raise TrajectoryStoreError(f"no committed trajectory version at {directory} (manifest.json missing)") from None
    except ValueError as exc:
        raise CorruptPartError(
            f"trajectory version {posixpath.basename(directory)}: manifest {path} is not valid JSON ({exc})"
        ) from None
    version = body.pop("version", None)
    if not isinstance(version, str):
        raise CorruptPartError(
            f"trajectory version {posixpath.basename(directory)}: manifest {path} has no version field"
        )
    check_schema_version(body.get("schema_version", "?"), f"trajectory version {version}")
    if version_id(body) != version:
        raise CorruptPartError(f"manifest of trajectory version {version} at {path} does not match its content hash")
    return Manifest(version, directory, body)


def read_table(root: StorageRoot, manifest: Manifest, columns: Iterable[str] | None = None):
    """All rows of a committed version, every part's sha256 verified first; adds ``trajectory_version``."""
    tables = []
    for part in manifest.parts:
        blob = _read_verified(root, manifest, part["path"], part["sha256"], "part")
        table = pq.read_table(io.BytesIO(blob), columns=list(columns) if columns else None)
        tables.append(table)
    table = pa.concat_tables(tables) if tables else arrow_schema().empty_table()
    return table.append_column(
        "trajectory_version", pa.repeat(pa.scalar(manifest.version, pa.string()), table.num_rows)
    )


def read_attachment(root: StorageRoot, manifest: Manifest, name: str) -> bytes | None:
    """A committed attachment's bytes, sha256 verified; None when the version has none of that name."""
    entry = (manifest.body.get("attachments") or {}).get(name)
    if entry is None:
        return None
    return _read_verified(root, manifest, name, entry["sha256"], "attachment")


def _read_verified(root: StorageRoot, manifest: Manifest, name: str, expected_sha256: str, what: str) -> bytes:
    """A file the manifest lists, read whole and checked against its recorded sha256."""
    path = child(manifest.directory, name)
    try:
        with root.fs.open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        raise CorruptPartError(f"trajectory version {manifest.version}: {what} {path} is missing") from None
    if sha256(blob) != expected_sha256:
        raise CorruptPartError(
            f"trajectory version {manifest.version}: {what} {path} is corrupted (sha256 mismatch); "
            "restore it from a copy or re-run the round"
        )
    return blob


def read_carryover(root: StorageRoot, manifest: Manifest) -> list[dict]:
    """The unfinished samples a round committed with its version (none: an empty list)."""
    blob = read_attachment(root, manifest, CARRYOVER)
    return [] if blob is None else pq.read_table(io.BytesIO(blob)).to_pylist()


def list_manifests(root: StorageRoot) -> list[Manifest]:
    """Every committed version under the root (directories without a manifest are invisible)."""
    found = []
    for pattern in root.manifest_globs():
        for path in root.glob(pattern):
            found.append(read_manifest(root, posixpath.dirname(path)))
    return found


def find_version(root: StorageRoot, version: str) -> Manifest:
    """Resolve a version id (or a unique prefix of at least 6 characters) to its manifest."""
    if len(version) < 6 or not all(c in "0123456789abcdef" for c in version):
        raise TrajectoryStoreError(
            f"trajectory version {version!r} must be at least 6 hex characters of a version id; "
            "list them with `rlrounds trajectories list`"
        )
    hits = []
    for pattern in root.manifest_globs():
        hits += root.glob(pattern.replace(f"/*/{MANIFEST}", f"/{version}*/{MANIFEST}"))
    if not hits:
        raise TrajectoryStoreError(
            f"no committed trajectory version {version!r} under {root.uri}; list them with `rlrounds trajectories list`"
        )
    if len({posixpath.basename(posixpath.dirname(h)) for h in hits}) > 1:
        raise TrajectoryStoreError(f"trajectory version prefix {version!r} is ambiguous; give more characters")
    return read_manifest(root, posixpath.dirname(hits[0]))


def committed_round_version(root: StorageRoot, run_id: str, round_index: int) -> Manifest | None:
    """The trajectory version a round committed, or None: how a resumed round knows rollout is done.

    One glob under the round's own directory, so it stays cheap however many rounds the root holds."""
    hits = root.glob(manifest_of(root.trajectory_version(run_id, round_index, "*")))
    if len(hits) > 1:
        versions = ", ".join(sorted(posixpath.basename(posixpath.dirname(h)) for h in hits))
        raise TrajectoryStoreError(
            f"round {round_index} of run {run_id} has {len(hits)} committed trajectory versions "
            f"({versions}); a round commits one, so remove the one its checkpoint does not name"
        )
    return read_manifest(root, posixpath.dirname(hits[0])) if hits else None


def parent_chain(root: StorageRoot, manifest: Manifest, limit: int = 100) -> list[Manifest]:
    """``manifest`` and its ancestors, nearest first, up to the rollout version a derivation started from."""
    chain = [manifest]
    while chain[-1].parent and len(chain) < limit:
        chain.append(find_version(root, chain[-1].parent))
    return chain
