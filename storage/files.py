"""Writing a small file so that readers see all of it or none of it: the one way commits are written.

On an object store a PUT appears whole or not at all. On a local disk the bytes go to a temporary
name beside the target first (flushed to disk) and are then renamed or linked into place, so a crash
mid-write leaves a stray ``*.tmp`` file (garbage ``rlrounds gc`` removes with its directory), never a
truncated marker that a reader would trust.
"""

from __future__ import annotations

import os
import posixpath
import secrets

from storage.paths import StorageRoot


class NoExclusiveCreate(RuntimeError):
    """The store cannot create a file only-if-absent, so it cannot hold a lock."""


def _write_aside(final: str, data: bytes) -> str:
    tmp = f"{final}.{secrets.token_hex(4)}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def write_atomic(root: StorageRoot, path: str, data: bytes) -> None:
    """Write (or replace) ``path`` under ``root`` all at once."""
    root.fs.makedirs(posixpath.dirname(path), exist_ok=True)
    if not root.is_local:
        root.fs.pipe_file(path, data)
        return
    final = path.removeprefix("file://")
    os.replace(_write_aside(final, data), final)


def create_exclusive(root: StorageRoot, path: str, data: bytes) -> bool:
    """Write ``path`` only if it does not exist, all at once; False when another writer got there first."""
    root.fs.makedirs(posixpath.dirname(path), exist_ok=True)
    if root.is_local:
        final = path.removeprefix("file://")
        tmp = _write_aside(final, data)
        try:
            os.link(tmp, final)  # atomic, and fails if the name exists: never a half-written claim
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
    if root.fs.exists(path):
        return False
    try:  # a conditional put: S3 (and moto, MinIO) refuse it with 412 when the key exists
        root.fs.pipe_file(path, data, mode="create")
        return True
    except FileExistsError:
        return False
    except (TypeError, NotImplementedError, ValueError) as exc:
        # Check-then-write cannot be exclusive between hosts; rather than a lock that silently is not
        # one, refuse: one writer per run id is what makes resume safe.
        raise NoExclusiveCreate(
            f"the store under {root.uri} cannot create {path} exclusively ({type(exc).__name__}: {exc}); "
            "use a local directory or an S3 store with conditional writes (If-None-Match)"
        ) from exc
