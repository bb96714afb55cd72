"""A campaign's durable records (storage/campaigns.py): one writer per run id, claimed and taken over
exclusively, and stage records that refuse other inputs and other record versions."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from storage import campaigns
from storage.campaigns import (
    CampaignError,
    Owner,
    assert_owner,
    claim,
    current_owner,
    owner_alive,
    process_started,
    read_stage,
    release,
    stored_config,
    write_stage,
)
from storage.paths import StorageRoot

CONFIG = {"rounds": 2, "run_id": "r1", "round": {"seed": 1}}
IDENTITY = {"experiment": "rlrounds", "round": {"seed": 1}}


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _record_owner(root: StorageRoot, run_id: str, **fields) -> None:
    """Rewrite the recorded first owner (a campaign started elsewhere, or by a process now dead)."""
    path = root.campaign_file(run_id)
    record = json.loads(open(path).read())
    record["owner"].update(fields)
    open(path, "w").write(json.dumps(record))


def _claim_at_once(root: StorageRoot, mode: str, threads: int) -> tuple[list[Owner], list[str]]:
    """``threads`` claims of run r1 started together: the owners won and the errors of those that lost."""
    won, lost = [], []

    def one():
        try:
            won.append(claim(root, "r1", CONFIG, IDENTITY, mode))
        except CampaignError as exc:
            lost.append(str(exc))

    started = [threading.Thread(target=one) for _ in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join()
    return won, lost


# -- ownership ---------------------------------------------------------------------------------------


def test_one_of_many_concurrent_starts_wins(tmp_path):
    root = StorageRoot.of(str(tmp_path))
    won, lost = _claim_at_once(root, "new", 8)
    assert len(won) == 1 and len(lost) == 7
    assert all("already holds a campaign" in m or "started by another process" in m for m in lost)
    assert os.listdir(os.path.dirname(root.campaign_file("r1"))) == ["campaign.json"]  # the losers wrote nothing
    release(won[0])


def test_new_refuses_an_existing_run_and_resume_a_missing_one(tmp_path):
    root = StorageRoot.of(str(tmp_path))
    with pytest.raises(CampaignError, match="no campaign 'r1'.*--run-id r1"):
        claim(root, "r1", CONFIG, IDENTITY, "resume")
    owner = claim(root, "r1", CONFIG, IDENTITY, "new")
    release(owner)
    with pytest.raises(CampaignError, match="already holds a campaign.*--resume r1"):
        claim(root, "r1", CONFIG, IDENTITY, "new")
    assert stored_config(root, "r1") == CONFIG


def test_resume_must_match_the_stored_config(tmp_path):
    root = StorageRoot.of(str(tmp_path))
    release(claim(root, "r1", CONFIG, IDENTITY, "new"))
    other = {"experiment": "rlrounds", "round": {"seed": 2}}
    with pytest.raises(CampaignError, match=r"round.seed: 1 \(stored\) vs 2 \(given\).*resume without --config"):
        claim(root, "r1", CONFIG, other, "resume")


def test_a_live_owner_keeps_its_campaign(tmp_path):
    root = StorageRoot.of(str(tmp_path))
    owner = claim(root, "r1", CONFIG, IDENTITY, "new")
    with pytest.raises(CampaignError, match="is still running as pid"):
        claim(root, "r1", CONFIG, IDENTITY, "resume")  # same process, token still held
    release(owner)
    _record_owner(root, "r1", token="elsewhere", pid=os.getppid(), pid_started=process_started(os.getppid()))  # alive
    with pytest.raises(CampaignError, match="is still running"):
        claim(root, "r1", CONFIG, IDENTITY, "auto")
    _record_owner(root, "r1", pid_started="1")  # the same pid, another process: the owner's pid was reused
    release(claim(root, "r1", CONFIG, IDENTITY, "auto"))


def test_a_dead_owner_is_taken_over_once(tmp_path):
    root = StorageRoot.of(str(tmp_path))
    release(claim(root, "r1", CONFIG, IDENTITY, "new"))
    _record_owner(root, "r1", token="dead", pid=_dead_pid())
    winners, losers = _claim_at_once(root, "resume", 6)
    assert len(winners) == 1 and all("resumed by another process" in m or "still running" in m for m in losers)
    record = json.load(open(root.campaign_file("r1")))
    assert winners[0].generation == 1 and current_owner(root, "r1", record) == winners[0]
    release(winners[0])


def test_a_resume_arriving_just_after_a_takeover_finds_its_owner_alive(tmp_path, monkeypatch):
    """The window six racing threads hit only now and then, opened on purpose: a second resume in the
    same process reads the new owner record the moment it exists, before the first claim returns."""
    root = StorageRoot.of(str(tmp_path))
    release(claim(root, "r1", CONFIG, IDENTITY, "new"))
    _record_owner(root, "r1", token="dead", pid=_dead_pid())
    create = campaigns._claim_file
    late = []

    def create_then_race(root_, path, data):
        created = create(root_, path, data)
        if created and not late:
            late.append(None)
            with pytest.raises(CampaignError, match="still running"):
                claim(root, "r1", CONFIG, IDENTITY, "resume")
        return created

    monkeypatch.setattr(campaigns, "_claim_file", create_then_race)
    first = claim(root, "r1", CONFIG, IDENTITY, "resume")
    assert late and first.generation == 1
    assert current_owner(root, "r1", json.load(open(root.campaign_file("r1")))) == first
    release(first)


def test_an_owner_that_exited_unreaped_is_not_alive():
    """A zombie still answers kill(pid, 0); it is a campaign that ended, not one running."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while process_started(child.pid) is not None:  # running, then a zombie: this test has not reaped it
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert owner_alive(Owner("t", child.pid, socket.gethostname(), "1", 0, 0.0)) is False
    finally:
        child.wait()
    assert owner_alive(Owner("t", os.getppid(), socket.gethostname(), process_started(os.getppid()), 0, 0.0))


def test_an_owner_on_another_host_needs_takeover_and_the_old_owner_stops(tmp_path):
    root = StorageRoot.of(str(tmp_path))
    first = claim(root, "r1", CONFIG, IDENTITY, "new")
    release(first)  # as if it had been started on the other host: this process holds nothing
    _record_owner(root, "r1", host="some-other-host")
    assert owner_alive(Owner("t", 1, "some-other-host", None, 0, 0.0)) is None
    with pytest.raises(CampaignError, match="cannot be checked from this host.*--takeover"):
        claim(root, "r1", CONFIG, IDENTITY, "resume")
    second = claim(root, "r1", CONFIG, IDENTITY, "resume", takeover=True)
    assert second.generation == 1 and socket.gethostname() == second.host
    with pytest.raises(CampaignError, match="now owned by pid"):
        assert_owner(root, "r1", first)  # the process that lost its campaign stops writing
    assert_owner(root, "r1", second)
    release(second)


def test_dry_run_checks_without_writing(tmp_path):
    root = StorageRoot.of(str(tmp_path))
    assert claim(root, "r1", CONFIG, IDENTITY, "new", dry_run=True) is None
    assert not os.path.exists(os.path.dirname(root.campaign_file("r1")))


# -- stage records -----------------------------------------------------------------------------------


def test_stage_records(tmp_path):
    root = StorageRoot.of(str(tmp_path))
    assert read_stage(root, "r1", 1, "train", "k1") is None
    write_stage(root, "r1", 1, "train", "k1", {"checkpoint": "/c", "stats": {"train/loss": 0.5}})
    assert read_stage(root, "r1", 1, "train", "k1") == {"checkpoint": "/c", "stats": {"train/loss": 0.5}}
    with pytest.raises(CampaignError, match="committed from other inputs"):
        read_stage(root, "r1", 1, "train", "k2")
    open(root.stage_record("r1", 1, "filter"), "w").write('{"stage": "fil')  # torn by a crash mid-write
    assert read_stage(root, "r1", 1, "filter", "k1") is None


def test_a_campaign_recorded_by_older_code_is_refused(tmp_path):
    root = StorageRoot.of(str(tmp_path))
    release(claim(root, "r1", CONFIG, IDENTITY, "new"))
    record = json.load(open(root.campaign_file("r1")))
    del record["record_version"]  # as the code before versioned records wrote it
    open(root.campaign_file("r1"), "w").write(json.dumps(record))
    with pytest.raises(
        CampaignError, match=r"another version of rlrounds.*start a new run id \(`rlrounds run --run-id"
    ):
        claim(root, "r1", CONFIG, IDENTITY, "resume", dry_run=True)
    write_stage(root, "r1", 1, "train", "k1", {"checkpoint": "/c"})
    body = json.load(open(root.stage_record("r1", 1, "train")))
    body["record_version"] = 1
    open(root.stage_record("r1", 1, "train"), "w").write(json.dumps(body))
    with pytest.raises(CampaignError, match="round 1 stage 'train'.*start a new run id"):
        read_stage(root, "r1", 1, "train", "k1")
