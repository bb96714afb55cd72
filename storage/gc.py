"""Garbage collection of uncommitted leftovers under a storage root.

Every writer commits by writing a marker last (manifest.json for a trajectory version, lineage.json
for a checkpoint); a crash before the marker leaves files that no reader will ever trust. This module
finds those directories and removes them once they are older than a grace period, so a writer that
is still working is left alone:

- trajectory version directories (round and derived) with parts but no manifest.json;
- rollout staging directories (a committed round deletes its own), unless a resumable round still
  needs one: its rollout stage is recorded as done but its trajectory version is not committed yet;
- checkpoint directories (round, replay, base) without lineage.json.

A committed directory is never touched: the marker is checked when the candidate is found and again
just before it is removed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from storage.paths import StorageRoot, lineage_of, manifest_of

DEFAULT_GRACE_S = 24 * 3600
"""A day: longer than any single write (a round's rollout, a checkpoint copy) takes."""
ROLLOUT_STAGE = "rollout"
"""The stage record (flows/stages.py) whose output is the staged rollout a resumed round filters."""


@dataclass
class Leftover:
    kind: str
    """'trajectories', 'checkpoint' or 'staging'."""
    path: str
    age_s: float
    bytes: int
    files: int


def _marker(kind: str, directory: str) -> str | None:
    return {"trajectories": manifest_of, "checkpoint": lineage_of}.get(kind, lambda _d: None)(directory)


def _mtime(info: dict[str, Any]) -> float | None:
    """Modification time of a file from a local (``mtime``) or S3 (``LastModified``) listing."""
    value = info.get("mtime", info.get("LastModified", info.get("last_modified")))
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value) if value is not None else None


def _describe(root: StorageRoot, kind: str, directory: str, now: float) -> Leftover:
    files = root.fs.find(directory, detail=True)
    times = [t for t in (_mtime(info) for info in files.values()) if t is not None]
    if not times:  # an empty local directory: its own time
        try:
            own = _mtime(root.fs.info(directory))
        except FileNotFoundError:
            own = None
        times = [own] if own is not None else [0.0]
    size = sum(int(info.get("size") or 0) for info in files.values())
    return Leftover(kind, directory, now - max(times), size, len(files))


def _awaited_by_resume(root: StorageRoot, staging: str) -> bool:
    """A staged rollout that a resumed round will filter: rollout recorded done, nothing committed yet."""
    found = root.round_of(staging)
    if found is None:
        return False
    run_id, round_index = found
    if not root.fs.exists(root.stage_record(run_id, round_index, ROLLOUT_STAGE)):
        return False
    return not root.glob(manifest_of(root.trajectory_version(run_id, round_index, "*")))


def find_leftovers(root: StorageRoot, grace_s: float, now: float | None = None) -> list[Leftover]:
    """Uncommitted directories whose newest file is older than ``grace_s`` seconds."""
    now = time.time() if now is None else now
    found = []
    for kind, patterns in root.leftover_globs().items():
        for pattern in patterns:
            for directory in root.glob(pattern):
                if not root.fs.isdir(directory):
                    continue
                marker = _marker(kind, directory)
                if marker and root.fs.exists(marker):
                    continue  # committed
                if kind == "staging" and _awaited_by_resume(root, directory):
                    continue
                leftover = _describe(root, kind, directory, now)
                if leftover.age_s >= grace_s:
                    found.append(leftover)
    return found


def collect(root: StorageRoot, grace_s: float = DEFAULT_GRACE_S, dry_run: bool = False) -> list[Leftover]:
    """Remove (or with ``dry_run`` only list) every leftover older than the grace period."""
    leftovers = find_leftovers(root, grace_s)
    if dry_run:
        return leftovers
    removed = []
    for leftover in leftovers:
        marker = _marker(leftover.kind, leftover.path)
        if hasattr(root.fs, "invalidate_cache"):
            root.fs.invalidate_cache(leftover.path)
        if marker and root.fs.exists(marker):
            continue  # committed since it was found: a slow writer finished
        root.fs.rm(leftover.path, recursive=True)
        removed.append(leftover)
    return removed
