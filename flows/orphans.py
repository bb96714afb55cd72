"""No process outlives the campaign that started it.

A campaign run without a Prefect server starts Prefect's ephemeral API server as a child process (and
Ray, vLLM's engine core, verifier workers as it goes). Every ``rlrounds`` process marks its environment
with its own identity, which its children inherit. A campaign stopped by SIGTERM unwinds as on Ctrl-C
and then stops every process it marked (``stop_children``). One killed with SIGKILL — an out-of-memory
kill, a preempted machine — cannot stop them, and they live on, adopted by init: each start terminates
the processes whose marking ``rlrounds`` process is gone (``reap_orphans``).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from storage.campaigns import process_started

OWNER_VAR = "RLROUNDS_OWNER"


def mark_this_process() -> None:
    """Children started from now on carry this process's identity."""
    os.environ[OWNER_VAR] = f"{os.getpid()}:{process_started(os.getpid())}"


def _owner_of(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except OSError:
        return None
    prefix = f"{OWNER_VAR}=".encode()
    for entry in environ:
        if entry.startswith(prefix):
            owner, _, started = entry[len(prefix) :].decode(errors="replace").partition(":")
            return (int(owner), started) if owner.isdigit() else None
    return None


def _marked() -> list[tuple[int, int, str]]:
    """(pid, marking pid, marking process's start) of this user's marked processes, this one left out."""
    if not os.path.isdir("/proc"):
        return []
    me, uid = os.getpid(), os.getuid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:  # another user's processes are theirs to manage
                continue
        except OSError:
            continue
        owner = _owner_of(int(name))
        if owner is not None:
            found.append((int(name), *owner))
    return found


def orphans() -> list[int]:
    """This user's processes marked by an ``rlrounds`` process that no longer runs."""
    me = os.getpid()
    # gone, or its pid now belongs to another process
    return [pid for pid, owner, started in _marked() if owner != me and process_started(owner) != started]


def children() -> list[int]:
    """The processes this process marked (its children, theirs, and what they started)."""
    me, started_here = os.getpid(), process_started(os.getpid())
    return [pid for pid, owner, started in _marked() if owner == me and started == started_here]


def reap_orphans(grace_s: float = 5.0) -> list[int]:
    """Terminate what killed campaigns left behind (SIGTERM, then SIGKILL after ``grace_s``); returns the pids."""
    victims = orphans()
    _stop(victims, grace_s)
    return victims


def stop_children(grace_s: float = 5.0) -> list[int]:
    """Terminate what this process started and has not stopped yet (SIGTERM, then SIGKILL); returns the pids."""
    victims = children()
    _stop(victims, grace_s)
    return victims


def _stop(victims: list[int], grace_s: float) -> None:
    for pid in victims:
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace_s
    for pid in victims:
        while process_started(pid) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def take_over(who: str) -> None:
    """Start of an ``rlrounds`` process (the CLI, a benchmark that runs campaigns): stop what killed ones
    left behind, saying so on stderr, then mark this one so that the next start stops what it leaves.
    A stray Prefect server would also take CPU from a benchmark's figures."""
    if reaped := reap_orphans():
        pids = ", ".join(map(str, reaped))
        print(f"{who}: stopped {len(reaped)} process(es) left by a killed rlrounds (pids {pids})", file=sys.stderr)
    mark_this_process()
