"""The trajectory store: Parquet parts plus a manifest, written last, that commits them.

A row is a ``TrajectoryRow``; ``arrow_schema`` is its Parquet form, and every file of a version (parts
and carry-over) is written with it, so its ``*.parquet`` files read as one table in any Parquet reader.
Rollout builds rows, stages them (``stage_rollout``) for filter to commit; readers get Arrow tables in
the current schema whatever minor version wrote the files (``conform``).

A trajectory version is immutable and content-addressed: its id is a hash of the manifest body,
which lists every part's sha256 and row count, the schema version, the version's parent and how it
was derived. Parts are written first; the manifest is the commit. Readers trust only versions with a
manifest and verify every part's sha256 before parsing it.

A round's version may carry attachments, files listed in the manifest with their sha256 and so
committed with it: ``carryover.parquet`` holds the round's unfinished samples (partial rollouts and
samples still waiting on the environment), which the next round resumes. They are not rows of the
version (nothing trains on them there), and their ``carry_state`` says so; ``read_carryover`` reads
them, verified like a part.

Rows do not store their own ``trajectory_version`` (the id is a hash over the parts, so a part
cannot contain it); readers attach it as a column from the manifest.
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from storage.files import write_atomic
from storage.paths import CARRYOVER, MANIFEST, StorageRoot, child, manifest_of, part_name

SCHEMA_VERSION = "1.3"  # 1.1: prompt_weight; 1.2: carry_state in every file of a version, so they share one schema;
# 1.3: turns (multi-turn episodes)
ROWS_PER_PART = 50_000


class TrajectoryStoreError(RuntimeError):
    pass


class CorruptPartError(TrajectoryStoreError):
    pass


@dataclass(frozen=True, kw_only=True, slots=True)
class TrajectoryRow:
    """One sample as the store holds it: its fields are the Parquet columns, in order (``arrow_schema``).

    Rollout builds rows of this type (tasks/rollout/rows.py) and the store turns them into Arrow once. Null
    fields: ``reward``/``outcome``/``verify_error`` before a verdict; ``advantage``/``kept``/``drop_reason``
    until filter decides; ``carry_state`` except on carried-over samples; ``prompt_weight`` before 1.1.
    """

    schema_version: str = SCHEMA_VERSION
    # identity
    run_id: str
    round: int
    prompt_id: str
    group_id: str
    sample_index: int
    # prompt
    task: str
    prompt_text: str
    prompt_token_ids: list[int]
    reference: str
    prompt_weight: float | None  # the probability the curriculum drew the prompt with
    # completion
    completion_text: str
    completion_token_ids: list[int]
    rollout_logprobs: list[float]
    token_policy_versions: list[int]
    finish_reason: str  # stop | length | abort (a partial rollout's prefix)
    engine: dict  # name, version, dtype
    sampling: dict  # temperature, top_p, seed, max_tokens
    # verification
    verifier: dict  # name, version
    reward: float | None
    outcome: str | None
    verify_error: str | None
    # filtering
    advantage: float | None = None
    kept: bool | None = None
    drop_reason: str | None = None
    # timing
    enqueued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    verified_at: datetime | None
    gen_latency_s: float
    verify_latency_s: float | None
    # carry-over: partial | unverified | verified on a round's unfinished samples, null on its rows
    carry_state: str | None = None
    # a multi-turn episode's turns (``EpisodeTurn`` as dicts), in order; null on a single-turn sample, whose every
    # completion token is the policy's
    turns: list[dict] | None = None


COLUMNS = tuple(f.name for f in fields(TrajectoryRow))

NOT_SAMPLED = -1
"""``token_policy_versions`` at a token no policy sampled: an environment's observation inside an episode."""


def policy_mask(row: Mapping[str, Any] | TrajectoryRow) -> list[bool] | None:
    """Per completion token, whether the policy sampled it (in the loss) or the environment wrote it (masked out):
    from the row's ``turns``; None for a single-turn row, whose every completion token is the policy's."""
    turns = row.get("turns") if isinstance(row, Mapping) else row.turns
    if not turns:
        return None
    ids = row["completion_token_ids"] if isinstance(row, Mapping) else row.completion_token_ids
    mask = [False] * len(ids)
    for turn in turns:
        mask[turn["start"] : turn["policy_end"]] = [True] * (turn["policy_end"] - turn["start"])
    return mask


def sampled_versions(versions: Iterable[int] | None) -> list[int]:
    """The policy versions of the tokens a policy sampled (an episode's observation tokens left out)."""
    return [v for v in versions or () if v != NOT_SAMPLED]


def policy_token_count(row: Mapping[str, Any]) -> int:
    """Completion tokens the policy sampled: all of a single-turn row's, an episode's turns' (not observations)."""
    turns = row.get("turns")
    if not turns:
        return len(row["completion_token_ids"])
    return sum(t["policy_end"] - t["start"] for t in turns)


def arrow_schema():
    """The Arrow form of ``TrajectoryRow``: one column per field, in field order. Every file of a
    version (its parts and its carry-over) is written with it."""

    ts = pa.timestamp("us", tz="UTC")
    types = {
        "schema_version": pa.string(),
        "run_id": pa.string(),
        "round": pa.int32(),
        "prompt_id": pa.string(),
        "group_id": pa.string(),
        "sample_index": pa.int32(),
        "task": pa.string(),
        "prompt_text": pa.string(),
        "prompt_token_ids": pa.list_(pa.int32()),
        "reference": pa.string(),
        "prompt_weight": pa.float64(),
        "completion_text": pa.string(),
        "completion_token_ids": pa.list_(pa.int32()),
        "rollout_logprobs": pa.list_(pa.float32()),
        "token_policy_versions": pa.list_(pa.int32()),
        "finish_reason": pa.string(),
        "engine": pa.struct([("name", pa.string()), ("version", pa.string()), ("dtype", pa.string())]),
        "sampling": pa.struct(
            [("temperature", pa.float64()), ("top_p", pa.float64()), ("seed", pa.int64()), ("max_tokens", pa.int32())]
        ),
        "verifier": pa.struct([("name", pa.string()), ("version", pa.string())]),
        "reward": pa.float64(),
        "outcome": pa.string(),
        "verify_error": pa.string(),
        "advantage": pa.float64(),
        "kept": pa.bool_(),
        "drop_reason": pa.string(),
        "enqueued_at": ts,
        "started_at": ts,
        "finished_at": ts,
        "verified_at": ts,
        "gen_latency_s": pa.float64(),
        "verify_latency_s": pa.float64(),
        "carry_state": pa.string(),
        "turns": pa.list_(
            pa.struct(
                [
                    ("start", pa.int32()),
                    ("policy_end", pa.int32()),
                    ("end", pa.int32()),
                    ("finish_reason", pa.string()),
                    ("prefill_tokens", pa.int32()),
                    ("step_s", pa.float64()),
                    ("action_text", pa.string()),
                    ("observation_text", pa.string()),
                ]
            )
        ),
    }
    if set(types) != set(COLUMNS):  # a field added to one and not the other would silently drop a column
        raise TypeError(f"arrow_schema and TrajectoryRow disagree on {sorted(set(types) ^ set(COLUMNS))}")
    return pa.schema([(name, types[name]) for name in COLUMNS])


def check_schema_version(found: str, where: str) -> None:
    major = str(found).split(".")[0]
    if major != SCHEMA_VERSION.split(".")[0]:
        raise TrajectoryStoreError(
            f"{where} has schema version {found}, this rlrounds reads major version {SCHEMA_VERSION.split('.')[0]}; "
            "upgrade rlrounds or export the data with the version that wrote it"
        )


def rows_to_table(rows: Sequence[TrajectoryRow | Mapping[str, Any]]):
    """Rows as one Arrow table of the current schema, stamped with its version. Mappings (rows read back
    and changed, by refilter or reverify) may leave columns out: they are null."""

    schema = arrow_schema()
    columns = []
    for column in schema:
        if column.name == "schema_version":
            values = [SCHEMA_VERSION] * len(rows)
        else:
            values = [r.get(column.name) if isinstance(r, Mapping) else getattr(r, column.name) for r in rows]
        columns.append(pa.array(values, type=column.type))
    return pa.Table.from_arrays(columns, schema=schema)


def rows_of(table) -> list[TrajectoryRow]:
    """The rows of a whole table (any schema version of this major: absent columns are null)."""
    table = conform(table)
    values = [table.column(name).to_pylist() for name in COLUMNS]
    return [TrajectoryRow(**dict(zip(COLUMNS, row))) for row in zip(*values)]


def conform(table, columns: Iterable[str] | None = None):
    """``table`` with exactly ``columns`` (default: every column of the current schema), in that order;
    a column its writer did not have (an older minor version) is added as nulls."""

    schema = arrow_schema()
    wanted = list(columns) if columns is not None else list(COLUMNS)
    for name in wanted:
        if name not in table.column_names:
            table = table.append_column(schema.field(name), pa.nulls(table.num_rows, schema.field(name).type))
    return table.select(wanted)


def table_bytes(table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


VERSION_ID_LENGTH = 20
"""Hex characters of a trajectory version id."""


def version_id(body: dict) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()[:VERSION_ID_LENGTH]


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
    """All rows of a committed version, every part's sha256 verified first; adds ``trajectory_version``.

    Columns come in the current schema's order (or ``columns``'), so parts an older minor version wrote
    read like new ones."""

    wanted = list(columns) if columns else list(COLUMNS)
    tables = []
    for part in manifest.parts:
        tables.append(parquet_table(_read_verified(root, manifest, part["path"], part["sha256"], "part"), wanted))
    table = pa.concat_tables(tables) if tables else conform(arrow_schema().empty_table(), wanted)
    return table.append_column(
        "trajectory_version", pa.repeat(pa.scalar(manifest.version, pa.string()), table.num_rows)
    )


PARQUET_READ_THREADS = False  # pyarrow 25/26 often abort at exit after a threaded read; docs/performance.md 2026-12-06


def parquet_table(blob: bytes, columns: Iterable[str] | None = None):
    """A Parquet file's rows in the current schema (``conform``); only ``columns`` are decoded."""
    wanted = list(columns) if columns else list(COLUMNS)
    present = set(pq.read_schema(pa.BufferReader(blob)).names)
    decoded = [c for c in wanted if c in present]
    return conform(pq.read_table(pa.BufferReader(blob), columns=decoded, use_threads=PARQUET_READ_THREADS), wanted)


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


def read_carryover(root: StorageRoot, manifest: Manifest) -> list[TrajectoryRow]:
    """The unfinished samples a round committed with its version (none: an empty list)."""
    blob = read_attachment(root, manifest, CARRYOVER)
    return [] if blob is None else rows_of(parquet_table(blob))


def list_manifests(root: StorageRoot) -> list[Manifest]:
    """Every committed version under the root (directories without a manifest are invisible)."""
    found = []
    for pattern in root.manifest_globs():
        for path in root.glob(pattern):
            found.append(read_manifest(root, posixpath.dirname(path)))
    return found


def find_version(root: StorageRoot, version: str, near: tuple[str, int] | None = None) -> Manifest:
    """Resolve a version id (or a unique prefix of at least 6 characters) to its manifest.

    ``near``: (run id, round) where a whole id is likely committed (a model version's lineage tags name them). That
    place and ``derived/`` are looked at directly; only an id found in neither is searched for over every run's
    rounds, a listing that grows with the root."""
    if len(version) < 6 or not all(c in "0123456789abcdef" for c in version):
        raise TrajectoryStoreError(
            f"trajectory version {version!r} must be at least 6 hex characters of a version id; "
            "list them with `rlrounds trajectories list`"
        )
    if len(version) == VERSION_ID_LENGTH:
        places = [root.trajectory_version(*near, version)] if near else []
        for directory in [*places, root.derived_version(version)]:
            if root.fs.exists(manifest_of(directory)):
                return read_manifest(root, directory)
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


# -- staging: a round's rollout output before filter commits it -------------------------------------


def stage_rollout(
    root: StorageRoot, run_id: str, round_index: int, rows: Sequence[TrajectoryRow], carry_rows: Sequence[TrajectoryRow]
) -> tuple[str, str]:
    """Write a round's rows and its carry-over to its staging directory, uncommitted (filter commits
    them with the round's version). Returns their URIs: (rows, carry-over)."""
    staging = root.rollout_staging_file(run_id, round_index)
    carryover = root.carryover_staging_file(run_id, round_index)
    root.fs.makedirs(root.staging(run_id, round_index), exist_ok=True)
    for uri, staged in ((carryover, carry_rows), (staging, rows)):
        with root.fs.open(uri, "wb") as f:
            f.write(table_bytes(rows_to_table(staged)))
    return staging, carryover


def missing_staged(root: StorageRoot, *uris: str | None) -> list[str]:
    """Those of ``uris`` (None: nothing staged) that are not there."""
    return [uri for uri in uris if uri is not None and not root.fs.exists(uri)]


def read_staged(root: StorageRoot, uri: str):
    """A staged rollout's rows as an Arrow table of the current schema."""
    with root.fs.open(uri, "rb") as f:
        return parquet_table(f.read())


def read_staged_carryover(root: StorageRoot, uri: str) -> bytes | None:
    """A staged carry-over's bytes, to attach to the version as they are; None when it holds no samples."""
    with root.fs.open(uri, "rb") as f:
        blob = f.read()
    return blob if pq.read_metadata(pa.BufferReader(blob)).num_rows else None


def clear_staging(root: StorageRoot, run_id: str, round_index: int) -> None:
    """Remove a round's staging directory, once its version is committed and the copy is redundant."""
    root.fs.rm(root.staging(run_id, round_index), recursive=True)
