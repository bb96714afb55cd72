"""Writing a small file so that readers see all of it or none of it: the one way commits are written.

On an object store a PUT appears whole or not at all. On a local disk the bytes go to a temporary
name beside the target first (flushed to disk) and are then renamed or linked into place, so a crash
mid-write leaves a stray ``*.tmp`` file (garbage ``rlrounds gc`` removes with its directory), never a
truncated marker that a reader would trust.
"""

from __future__ import annotations

import json
import os
import posixpath
import secrets
import socket
import time
from contextlib import contextmanager

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


def probe_writable(root: StorageRoot) -> None:
    """Write and remove a small file at the top of ``root``: raises whatever stops the store taking files."""
    root.fs.makedirs(root.uri, exist_ok=True)
    probe = root.join(f".write-probe-{secrets.token_hex(16)}")
    with root.fs.open(probe, "wb") as f:
        f.write(b"ok")
    root.fs.rm(probe)


class LeaseTimeout(TimeoutError):
    pass


def _holder_gone(held: dict) -> bool:
    """A lease taken on this host by a process that no longer exists (a holder on another host cannot
    be checked from here: its lease lapses after its ttl)."""
    pid = held.get("pid")
    if held.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists, under another user
    return False


@contextmanager
def lease(root: StorageRoot, path: str, *, ttl_s: float = 300.0, wait_s: float = 600.0, poll_s: float = 0.2):
    """Hold ``path`` as an exclusive lease while the block runs: a small file created only-if-absent
    (``create_exclusive``), removed on the way out. Another holder is waited for up to ``wait_s``; a
    lease older than ``ttl_s``, or one taken on this host by a process that is gone, belongs to a holder
    that died and is broken, so ``ttl_s`` must be well above the longest time the block can take. Good
    for critical sections shared by processes and hosts on one storage root (a champion's
    read-compare-set, a base built once), not for long ownership."""
    token = secrets.token_hex(8)
    deadline = time.monotonic() + wait_s
    while True:
        body = json.dumps({"token": token, "pid": os.getpid(), "host": socket.gethostname(), "at": time.time()})
        if create_exclusive(root, path, body.encode()):
            break
        held: dict = {}
        try:
            held = json.loads(root.fs.cat_file(path))
            if time.time() - float(held.get("at", 0)) > ttl_s or _holder_gone(held):
                root.fs.rm(path)  # a dead holder's: break it, then race for it like everyone else
                continue
        except FileNotFoundError:
            continue  # released between our attempt and the read
        except (ValueError, TypeError):
            pass  # being written (object stores show it whole; a local link is atomic): look again
        if time.monotonic() > deadline:
            raise LeaseTimeout(
                f"{path} has been held by pid {held.get('pid')} on {held.get('host')} for over {wait_s:.0f} s; "
                f"if that process is gone, delete the file (it expires by itself after {ttl_s:.0f} s)"
            )
        time.sleep(poll_s)
    try:
        yield
    finally:
        try:
            if json.loads(root.fs.cat_file(path)).get("token") == token:
                root.fs.rm(path)
        except (FileNotFoundError, ValueError):
            pass
