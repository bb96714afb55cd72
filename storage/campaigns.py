"""A campaign's durable state: the config it runs, who owns it, and which stages each round committed.

    <run>/campaign.json                    written once, exclusively, by the process that starts the
                                           campaign: the config every resume must match, and the first owner
    <run>/owners/<generation>.json         a resume's takeover, created exclusively: of two resumes racing,
                                           one creates the next generation and the other fails
    <run>/rounds/<k>/stages/<stage>.json   a stage's result, written after the stage committed its output

Ownership is what keeps two processes from writing one campaign. A resume may take over only when
the current owner is gone: on this host that is checked (pid and process start time); an owner on
another host cannot be checked from here, so taking it over needs an explicit ``takeover``.

The stage records are a cache of each stage's small result (URIs, versions, stats) keyed by the
stage's inputs; every stage is also idempotent on its own commit marker, so a crash between a commit
and its record only costs re-reading what was committed. A torn record reads as absent.
"""

from __future__ import annotations

import json
import os
import posixpath
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

from storage.files import NoExclusiveCreate, create_exclusive, write_atomic
from storage.paths import StorageRoot

RECORD_VERSION = 4
"""The format of the stage records and how flows/stages.py derives their inputs keys. Bump it when
either changes: a campaign recorded under another version is refused, never resumed wrongly."""


class CampaignError(RuntimeError):
    """A campaign cannot be started or resumed as asked; the message names the fix."""


@dataclass(frozen=True)
class Owner:
    token: str
    pid: int
    host: str
    pid_started: str | None  # the process's start time, so a reused pid is not mistaken for the owner
    generation: int
    claimed_at: float

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.claimed_at))
        return f"pid {self.pid} on host {self.host} (since {since})"


_HELD: set[str] = set()  # tokens this process holds; released when its campaign flow ends


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the name (the state first); None where there is no such file."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # the name before ")" may hold spaces
    except OSError:
        return None


def process_started(pid: int) -> str | None:
    """A running process's start time (clock ticks since boot), so a reused pid is never taken for the
    process it replaced; None when no such process runs (a zombie has exited)."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20 or fields[0] == "Z":  # fields[0] is the state, fields[19] field 22, starttime
        return None
    return fields[19]


def _this_process(generation: int) -> Owner:
    pid = os.getpid()
    return Owner(secrets.token_hex(8), pid, socket.gethostname(), process_started(pid), generation, time.time())


def owner_alive(owner: Owner) -> bool | None:
    """True / False, or None when the owner runs on another host and cannot be checked from here."""
    if owner.token in _HELD:
        return True
    if owner.host != socket.gethostname():
        return None
    if owner.pid == os.getpid():
        return False  # this process, and it no longer holds the token: that campaign ended
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, under another user
    fields = _stat_fields(owner.pid)
    if fields and fields[0] == "Z":
        return False  # it exited; nobody has reaped it (an orphan where the init process does not reap)
    started = process_started(owner.pid)
    return not (owner.pid_started and started and started != owner.pid_started)


# -- files created once ---------------------------------------------------------------------------


def _claim_file(root: StorageRoot, path: str, data: bytes) -> bool:
    try:
        return create_exclusive(root, path, data)
    except NoExclusiveCreate as exc:
        raise CampaignError(str(exc)) from None


def _create_owned(root: StorageRoot, path: str, owner: Owner, data: bytes) -> bool:
    """Create an owner record, holding its token from before the record exists: a claim in this process
    that reads the record a moment after it appears must already find its owner alive (owner_alive
    takes a token of this process's pid that is not held for an ended campaign's)."""
    _HELD.add(owner.token)
    created = False
    try:
        created = _claim_file(root, path, data)
        return created
    finally:
        if not created:
            _HELD.discard(owner.token)


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body, indent=2, sort_keys=True, default=str).encode()


def check_record_version(found: Any, what: str) -> None:
    if found != RECORD_VERSION:
        raise CampaignError(
            f"{what} was recorded by another version of rlrounds (stage records v{found}, this code reads "
            f"v{RECORD_VERSION}) and cannot be resumed by it; start a new run id (`rlrounds run --run-id NEW_ID`), "
            "or resume it with the code that started it"
        )


def _read_json(root: StorageRoot, path: str) -> dict | None:
    try:
        with root.fs.open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def read_campaign(root: StorageRoot, run_id: str) -> dict | None:
    """The campaign record (run_id, config, config_hash, owner) or None when the run id is unused."""
    path = root.campaign_file(run_id)
    try:
        return _read_json(root, path)
    except ValueError:
        raise CampaignError(
            f"{path} is not valid JSON; restore it, or start the campaign under a new --run-id"
        ) from None


def current_owner(root: StorageRoot, run_id: str, record: dict) -> Owner:
    takeovers = root.glob(posixpath.join(root.campaign_owners(run_id), "*.json"))
    body = _read_json(root, takeovers[-1]) if takeovers else record["owner"]  # zero-padded names sort by generation
    return Owner(**body)


# -- claiming ----------------------------------------------------------------------------------------


def describe_difference(stored: dict, given: dict, prefix: str = "") -> list[str]:
    """Dotted fields whose values differ between two nested config dicts."""
    out = []
    for key in sorted(set(stored) | set(given)):
        a, b = stored.get(key), given.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += describe_difference(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} (stored) vs {b!r} (given)")
    return out


def claim(
    root: StorageRoot,
    run_id: str,
    config: dict,
    identity: dict,
    mode: Literal["new", "resume", "auto"],
    takeover: bool = False,
    dry_run: bool = False,
) -> Owner | None:
    """Make this process the campaign's only writer, or fail with one line naming the fix.

    config: the whole campaign config (stored, so a resume can reuse it); identity: the part a resume
    must match (everything but the round count and stopping rule). mode 'new' refuses an existing run
    id, 'resume' a missing one, 'auto' (a re-run Prefect flow) accepts both. dry_run: check only.
    """
    record = read_campaign(root, run_id)
    if record is None:
        if mode == "resume":
            raise CampaignError(
                f"no campaign {run_id!r} under {root.uri}; check --storage, or start it with `rlrounds run --run-id "
                f"{run_id}`"
            )
        if dry_run:
            return None
        owner = _this_process(0)
        body = {
            "run_id": run_id,
            "identity": identity,
            "config": config,
            "created_at": time.time(),
            "owner": asdict(owner),
            "record_version": RECORD_VERSION,
        }
        if not _create_owned(root, root.campaign_file(run_id), owner, _json(body)):
            raise CampaignError(
                f"campaign {run_id!r} was started by another process a moment ago; "
                f"pick another --run-id, or resume it later with `rlrounds run --resume {run_id}`"
            )
        return owner
    if mode == "new":
        raise CampaignError(
            f"run id {run_id!r} already holds a campaign under {root.uri}; "
            f"resume it with `rlrounds run --resume {run_id}` or pick another --run-id"
        )
    check_record_version(record.get("record_version", 1), f"campaign {run_id!r}")
    if record.get("identity") != identity:
        diff = describe_difference(record.get("identity") or {}, identity)
        more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
        raise CampaignError(
            f"campaign {run_id!r} was started with another config: {'; '.join(diff[:3])}{more}; "
            "resume without --config to use the stored one, or start a new --run-id"
        )
    owner = current_owner(root, run_id, record)
    alive = owner_alive(owner)
    if alive:
        raise CampaignError(
            f"campaign {run_id!r} is still running as {owner.describe()}; wait for it or stop it before resuming"
        )
    if alive is None and not takeover:
        raise CampaignError(
            f"campaign {run_id!r} is owned by {owner.describe()}, which cannot be checked from this host; "
            "if that process is gone, resume with --takeover"
        )
    if dry_run:
        return None
    successor = _this_process(owner.generation + 1)
    if not _create_owned(root, root.campaign_owner(run_id, successor.generation), successor, _json(asdict(successor))):
        raise CampaignError(f"campaign {run_id!r} was resumed by another process a moment ago; let that one finish")
    return successor


def assert_owner(root: StorageRoot, run_id: str, owner: Owner) -> None:
    """Called between rounds: a process that lost its campaign to a takeover stops writing."""
    record = read_campaign(root, run_id)
    current = current_owner(root, run_id, record) if record else None
    if current is None or current.token != owner.token:
        who = current.describe() if current else "nobody (campaign.json is gone)"
        raise CampaignError(f"campaign {run_id!r} is now owned by {who}; this process stops without writing more")


def release(owner: Owner | None) -> None:
    if owner is not None:
        _HELD.discard(owner.token)


def stored_config(root: StorageRoot, run_id: str) -> dict:
    """The config a campaign was started with (what `rlrounds run --resume` runs when given none)."""
    record = read_campaign(root, run_id)
    if record is None:
        raise CampaignError(
            f"no campaign {run_id!r} under {root.uri}; check --storage, or start it with `rlrounds run --run-id "
            f"{run_id}`"
        )
    return record["config"]


# -- stage records ---------------------------------------------------------------------------------


def read_stage(root: StorageRoot, run_id: str, round_index: int, stage: str, inputs: str) -> dict | None:
    """A committed stage's result, or None when the stage has not finished (or its record is torn)."""
    path = root.stage_record(run_id, round_index, stage)
    try:
        body = _read_json(root, path)
    except ValueError:
        return None  # a crash mid-write: the stage runs again, and it is idempotent
    if body is None:
        return None
    check_record_version(
        body.get("record_version", 1), f"round {round_index} stage {stage!r} of campaign {run_id!r} ({path})"
    )
    if body.get("inputs") != inputs:
        raise CampaignError(
            f"round {round_index} stage {stage!r} of campaign {run_id!r} was committed from other inputs "
            f"({path}); resume with the config the campaign was started with, or start a new --run-id"
        )
    return body["output"]


def write_stage(root: StorageRoot, run_id: str, round_index: int, stage: str, inputs: str, output: dict) -> None:
    body = {
        "stage": stage,
        "round": round_index,
        "record_version": RECORD_VERSION,
        "inputs": inputs,
        "committed_at": time.time(),
        "output": output,
    }
    write_atomic(root, root.stage_record(run_id, round_index, stage), _json(body))
