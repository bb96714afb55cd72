"""The checkpoint store: Hugging Face directories under the storage root, ``lineage.json`` written last.

Training happens on local disk; a finished checkpoint is copied to its place under the root file by
file, lineage.json last, so a checkpoint without lineage.json is an interrupted copy and is never
loaded. Remote checkpoints are fetched into a local cache keyed by URI and content before loading.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

from storage.files import write_atomic
from storage.paths import LINEAGE, StorageRoot, child, lineage_of, local_cache_dir


class CheckpointError(RuntimeError):
    pass


def commit_checkpoint(root: StorageRoot, local_dir: str, target: str, lineage: dict) -> str:
    """Copy ``local_dir`` to ``target`` under the root and commit it with ``lineage``. Returns target."""
    fs = root.fs
    if fs.exists(lineage_of(target)):
        return target  # already committed: a resumed stage must not rewrite a published checkpoint
    fs.makedirs(target, exist_ok=True)
    for folder, _, names in sorted(os.walk(local_dir)):  # nested: a worker group's optimizer shards
        inside = os.path.relpath(folder, local_dir)
        if inside != ".":
            fs.makedirs(child(target, *inside.split(os.sep)), exist_ok=True)
        for name in sorted(names):
            if name == LINEAGE and inside == ".":
                continue
            parts = [] if inside == "." else inside.split(os.sep)
            fs.put_file(os.path.join(folder, name), child(target, *parts, name))
    write_atomic(root, lineage_of(target), json.dumps(lineage, indent=2, sort_keys=True).encode())
    return target


def is_committed(root: StorageRoot, checkpoint_uri: str) -> bool:
    return root.fs.exists(lineage_of(checkpoint_uri))


def read_lineage(root: StorageRoot, checkpoint_uri: str) -> dict:
    try:
        with root.fs.open(lineage_of(checkpoint_uri), "r") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {checkpoint_uri} is not committed (no {LINEAGE}); re-run its round"
        ) from None


def base_checkpoint(root: StorageRoot, checkpoint_uri: str) -> str:
    """The starting checkpoint ``checkpoint_uri`` descends from (itself when it is one).

    Round checkpoints record ``base_checkpoint`` (older ones only ``parent_checkpoint``, which is
    followed); a built base has no parent, and a base given as a plain Hugging Face directory has no
    lineage at all."""
    seen: set[str] = set()
    uri = checkpoint_uri
    while uri not in seen:
        seen.add(uri)
        lineage = _lineage_if_any(root, uri)
        if lineage is None or lineage.get("kind") == "base":
            return uri
        if lineage.get("base_checkpoint"):
            return lineage["base_checkpoint"]
        if not lineage.get("parent_checkpoint"):
            return uri
        uri = lineage["parent_checkpoint"]
    raise CheckpointError(
        f"checkpoint lineage of {checkpoint_uri} loops back to {uri}; its lineage.json files are corrupt"
    )


def _lineage_if_any(root: StorageRoot, checkpoint_uri: str) -> dict | None:
    if "://" not in checkpoint_uri:  # a local directory, whatever the root (a base given by path)
        path = lineage_of(checkpoint_uri)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)
    try:
        return read_lineage(root, checkpoint_uri)
    except CheckpointError:
        return None


def local_copy(root: StorageRoot, checkpoint_uri: str) -> str:
    """A local directory holding the checkpoint: the directory itself when local, else a cached copy."""
    if "://" not in checkpoint_uri:  # a local directory (a local root, or a base model given by path)
        return checkpoint_uri
    if not is_committed(root, checkpoint_uri):
        raise CheckpointError(f"checkpoint {checkpoint_uri} is not committed (no {LINEAGE})")
    with root.fs.open(lineage_of(checkpoint_uri), "rb") as f:
        stamp = hashlib.sha256(checkpoint_uri.encode() + f.read()).hexdigest()[:16]
    target = os.path.join(local_cache_dir(), "checkpoints", stamp)
    if os.path.exists(os.path.join(target, LINEAGE)):
        return target
    staging = tempfile.mkdtemp(
        prefix="ckpt-", dir=os.path.dirname(target) if os.path.isdir(os.path.dirname(target)) else None
    )
    base = root.fs._strip_protocol(checkpoint_uri).rstrip("/")
    for path in root.fs.find(checkpoint_uri):  # every file, nested ones (optimizer shards) included
        local = os.path.join(staging, *root.fs._strip_protocol(path)[len(base) + 1 :].split("/"))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        root.fs.get_file(path, local)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    try:
        os.rename(staging, target)
    except OSError:  # another process fetched it first
        shutil.rmtree(staging, ignore_errors=True)
    return target
