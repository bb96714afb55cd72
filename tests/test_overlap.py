"""Overlap mode: weights updated between two decode steps, every token labelled with the version that
sampled it and a behaviour logprob that version reproduces; and an overlapped campaign, killed while the
next round's rollout runs beside training, resumes to the uninterrupted result."""

import os

import pytest
import torch

from models.checkpoint import load_policy, save_policy
from models.engines.embedded import EmbeddedEngine
from models.engines.types import GroupRequest, SamplingParams
from models.logprobs import logprobs_by_version
from tasks.rollout.overlap import UpdateAtStep
from tests.test_resume import (  # noqa: F401 -- weak_base is a fixture
    TIMING_COLUMNS,
    Campaign,
    _same_tree,
    _tensors,
    config_file,
    weak_base,
)

PROMPTS = ["1+2=", "34+56=", "7+89=", "99+99=", "5+5=", "12+3="]


@pytest.fixture(scope="module")
def two_versions(tiny_policy_dir, tmp_path_factory):
    """Version 1 (the tiny policy) and version 2 (the same, every weight moved by about 5%)."""
    newer = str(tmp_path_factory.mktemp("version-2"))
    model, tok = load_policy(tiny_policy_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.std() * torch.randn_like(p))
    save_policy(model, tok, newer)
    return tiny_policy_dir, newer


def _generate(two_versions, update_kv: str, step: int = 4):
    older, newer = two_versions
    model, tok = load_policy(older)
    engine = EmbeddedEngine(
        model, tok.eos_token_id, tok.pad_token_id, max_batch=8, policy_version=1, update_kv=update_kv
    )
    update = UpdateAtStep(newer, 2, step)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    groups = [GroupRequest(f"g{i}", tuple(tok(p)["input_ids"]), 2, params) for i, p in enumerate(PROMPTS)]
    samples = list(engine.generate(groups, None, update))
    models = {1: load_policy(older)[0], 2: load_policy(newer)[0]}
    return samples, logprobs_by_version(models, samples, tok.pad_token_id), update


def test_a_sample_updated_mid_generation_records_both_versions_and_their_logprobs(two_versions):
    samples, recomputed, update = _generate(two_versions, "recompute")
    assert update.pause_s is not None and len(samples) == 2 * len(PROMPTS)
    spanning = [s for s in samples if set(s.token_policy_versions) == {1, 2}]
    assert spanning, "no sample was in flight at the update"
    assert any(s.token_policy_versions == [2] * len(s.token_ids) for s in samples)  # admitted after it
    for s, expected in zip(samples, recomputed):
        switch = s.token_policy_versions.index(2) if 2 in s.token_policy_versions else len(s.token_ids)
        assert s.token_policy_versions == [1] * switch + [2] * (len(s.token_ids) - switch)  # one switch, in order
        # every token's behaviour logprob is what its own version gives, recomputed from scratch
        assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(expected), atol=1e-4), s.group_id


def test_keeping_the_old_cache_is_a_measurable_mismatch(two_versions):
    """'keep' samples the tokens after an update from new weights over a cache of old ones: neither
    version reproduces them. The same draw with 'recompute' is exact (above)."""
    samples, recomputed, _ = _generate(two_versions, "keep")
    before, after = [], []
    for s, expected in zip(samples, recomputed):
        versions = s.token_policy_versions
        if set(versions) != {1, 2}:
            continue
        for i, (got, want) in enumerate(zip(s.logprobs, expected)):
            (after if versions[i] == 2 else before).append(abs(got - want))
    assert before and after
    assert max(before) < 1e-4  # before the update nothing differs
    assert sum(after) / len(after) > 1e-3  # after it, the stale cache shows


# -- the hand-over and its config ----------------------------------------------------------------------


def test_the_hand_over_waits_for_the_checkpoint_and_a_cancelled_one_stops_the_rollout(tmp_path):
    import threading
    import time

    from tasks.rollout.overlap import NextPolicy, RolloutCancelled

    handed = NextPolicy(str(tmp_path), str(tmp_path / "ckpt"), 4, after_samples=10)
    assert not handed.due(9) and handed.due(10)
    threading.Timer(0.2, handed.committed).start()
    directory, version = handed.take()  # blocks until the trainer commits
    handed.applied(0.01)
    stats = handed.stats()
    assert version == 4 and directory == str(tmp_path / "ckpt")
    assert stats["rollout/weight_update_applied"] == 1 and stats["rollout/weight_update_wait_s"] >= 0.15
    assert stats["rollout/weight_update_lag_s"] == 0  # due before the weights were ready: no lag, a wait

    late = NextPolicy(str(tmp_path), str(tmp_path / "ckpt"), 4, after_samples=10)
    late.committed()
    time.sleep(0.05)
    late.take()
    late.applied(0.0)
    assert late.stats()["rollout/weight_update_wait_s"] < 0.05 and late.stats()["rollout/weight_update_lag_s"] >= 0.04

    failed = NextPolicy(str(tmp_path), str(tmp_path / "ckpt"), 4, after_samples=10)
    threading.Timer(0.1, failed.cancel, args=("round 3 failed",)).start()
    with pytest.raises(RolloutCancelled, match="round 3 failed"):
        failed.take()
    assert failed.cancelled and failed.stats()["rollout/weight_update_applied"] == 0


@pytest.mark.parametrize(
    "round_config, message",
    [
        ({"rollout": {"collection": "sync_barrier", "partial_rollouts": False}}, "needs rollout.collection"),
        ({"rollout": {"replicas": 2}}, "set rollout.replicas"),
    ],
)
def test_overlap_refuses_what_it_cannot_update_in_flight(round_config, message):
    from flows.config import ConfigError, load_campaign_config

    with pytest.raises(ConfigError, match=message):
        load_campaign_config(None, round={"mode": "overlap", **round_config})
    assert load_campaign_config(None, round={"mode": "overlap"}).round.update_after_samples == 0.5 * 2048 * 4


@pytest.mark.slow
def test_a_round_that_fails_cancels_the_rollout_waiting_for_its_weights(
    prefect_harness, seed_builtin_base, tmp_path, monkeypatch
):
    """Round 1's train fails (in-process, after its commit, before its record): round 2's rollout, which
    cannot pass its update point without round 1's weights, is cancelled and not recorded; the re-run
    campaign then finishes, and a campaign that stops early (stop_at_accuracy) ends after that round."""
    from flows import stages
    from flows.campaign import rl_campaign
    from flows.config import CampaignConfig
    from storage.paths import StorageRoot

    class Lost(Exception):
        pass

    def fail_after_train_1(stage, round_index):
        if (stage, round_index) == ("train", 1):
            raise Lost("worker lost")

    storage = str(tmp_path / "data")
    seed_builtin_base(storage)
    root = StorageRoot.of(storage)
    # the update point after the first finished sample, and no partial rollouts: round 2's rollout carries
    # nothing over from round 1 and is never stopped early, so it always reaches the update point and waits
    # there. (With partial rollouts, round 1's samples carried unverified could fill round 2's batch of 4
    # trainable groups before any sample finished, and the rollout then ended without the weights.)
    small = {
        "mode": "overlap",
        "overlap_update_after": 0.05,
        "rollout": {"max_batch": 64, "partial_rollouts": False},
        "train": {"groups_per_step": 2, "steps_per_round": 2},
    }
    config = CampaignConfig.model_validate({"rounds": 2, "run_id": "cancel", "round": small})
    monkeypatch.setattr(stages, "crash_point", fail_after_train_1)
    with pytest.raises(Lost):
        rl_campaign(config, storage=storage)
    assert os.path.exists(root.stage_record("cancel", 1, "filter"))
    assert not os.path.exists(root.stage_record("cancel", 2, "rollout"))  # cancelled, not recorded
    monkeypatch.undo()
    result = rl_campaign(config, storage=storage)
    assert [r["round"] for r in result["rounds"]] == [0, 1, 2]
    assert os.path.exists(root.stage_record("cancel", 2, "rollout"))

    early = CampaignConfig.model_validate({"rounds": 3, "run_id": "early", "stop_at_accuracy": 0.0, "round": small})
    assert [r["round"] for r in rl_campaign(early, storage=storage)["rounds"]] == [0, 1]
    assert os.path.exists(root.stage_record("early", 1, "record"))


# -- a killed overlapped campaign ----------------------------------------------------------------------

OVERLAP_CONFIG = {
    "rounds": 3,
    "experiment": "overlap",
    "round": {
        "mode": "overlap",
        "overlap_update_after": 0.25,
        "train": {"groups_per_step": 4, "steps_per_round": 2},
        "publish": {"model_name": "overlap-policy"},
        "seed": 7,
    },
}
# train:1 and train:2 die while the next round's rollout runs beside training; rollout:2 dies after the
# overlapped rollout staged its rows, before its record.
KILL_POINTS = ["train:1", "rollout:2", "train:2"]


def _rows(storage, k):
    from storage.paths import StorageRoot
    from storage.trajectories import committed_round_version, read_table

    manifest = committed_round_version(StorageRoot.of(storage), "overlap", k)
    return [
        {c: v for c, v in r.items() if c not in TIMING_COLUMNS}
        for r in read_table(StorageRoot.of(storage), manifest).to_pylist()
    ]


def _task_runs(flow_run_name: str) -> dict[str, list[tuple]]:
    """(start, end) of the task runs in the first flow run of that name, by task name, in start order."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName

    with get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[flow_run_name])))
        first = min(flow_runs, key=lambda r: r.start_time)
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[first.id])))
    spans: dict[str, list[tuple]] = {}
    for r in sorted(runs, key=lambda r: r.start_time):
        spans.setdefault(r.name.rsplit("-", 1)[0], []).append((r.start_time, r.end_time))
    return spans


@pytest.mark.slow
def test_a_killed_overlapped_campaign_resumes_to_the_uninterrupted_result(prefect_harness, weak_base, tmp_path):  # noqa: F811
    from storage.paths import StorageRoot

    config_path = config_file(tmp_path, OVERLAP_CONFIG, weak_base)
    reference, crashed = Campaign(str(tmp_path / "reference")), Campaign(str(tmp_path / "crashed"))
    out, _ = reference.run("--config", config_path, "--run-id", "overlap")
    assert "round 3:" in out

    # The Prefect flow run of round 1 shows round 2's rollout as its own task run, running beside train.
    tasks = _task_runs("overlap-round-1")
    assert {"rollout", "filter+store", "train", "publish", "evaluate"} <= set(tasks)
    assert len(tasks["rollout"]) == 2  # round 1's own, then round 2's
    rollout_2, (train_1,) = tasks["rollout"][1], tasks["train"]
    assert rollout_2[0] < train_1[1] and train_1[0] < rollout_2[1]  # the two intervals intersect

    crashed.run("--config", config_path, "--run-id", "overlap", crash_after=KILL_POINTS[0], expect_crash=True)
    for point in KILL_POINTS[1:]:
        crashed.run("--resume", "overlap", crash_after=point, expect_crash=True)
    crashed.run("--resume", "overlap")

    spanning = 0
    for k in (1, 2, 3):
        ref_rows, rows = _rows(reference.storage, k), _rows(crashed.storage, k)
        assert rows == ref_rows and rows, f"round {k} rows differ"
        versions = [set(r["token_policy_versions"]) for r in rows]
        # the parent, or before the update its parent; a sample carried over from the last round may be older
        assert all(v <= set(range(max(0, k - 3), k)) for v in versions)
        spanning += sum(len(v) == 2 for v in versions)
        ckpt, ref_ckpt = (StorageRoot.of(s).checkpoint("overlap", k) for s in (crashed.storage, reference.storage))
        assert _same_tree(_tensors(ckpt), _tensors(ref_ckpt)), f"round {k} checkpoint differs"
    assert spanning > 0, "no sample spanned a weight update"
    assert os.path.exists(StorageRoot.of(crashed.storage).stage_record("overlap", 3, "rollout"))
