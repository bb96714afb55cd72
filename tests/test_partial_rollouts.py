"""Partial rollouts through the rollout stage's own code (embedded engine, real verifier pool, Parquet
carry-over): a round stops its stragglers, the next resumes them under newer weights, and every
sample is stored exactly once, in the round that finished it, with the versions that sampled it."""

from __future__ import annotations

import copy

import pytest
import torch

from models.checkpoint import load_policy, save_policy
from models.engines.embedded import EmbeddedEngine
from storage.trajectories import parquet_table, rows_of, rows_to_table, table_bytes
from tasks.config.filter import FilterConfig
from tasks.config.prompts import PromptsConfig
from tasks.config.rollout import RolloutConfig
from tasks.config.verify import VerifyConfig
from tasks.rollout.collection import RolloutCollection

# A random policy scores 0 everywhere; keeping zero-variance groups makes every complete group trainable.
FILTER = FilterConfig(drop_zero_variance=False)
ROLLOUT = RolloutConfig(samples_per_prompt=4, max_tokens=10, max_batch=16)


def _round(engine, tok, round_index, carried=None, rollout=ROLLOUT):
    return RolloutCollection(
        engine,
        tok,
        prompts=PromptsConfig(),
        rollout=rollout,
        verify=VerifyConfig(),
        filtering=FILTER,
        target_groups=3,
        seed=100 + round_index,
        run_id="t",
        round_index=round_index,
    ).collect(carried_rows=carried)


def _through_parquet(rows):
    return rows_of(parquet_table(table_bytes(rows_to_table(rows))))


@pytest.fixture(scope="module")
def rounds(tiny_policy_dir, tmp_path_factory):
    model, tok = load_policy(tiny_policy_dir)
    engine = EmbeddedEngine(copy.deepcopy(model), tok.eos_token_id, tok.pad_token_id, max_batch=ROLLOUT.max_batch)
    first = _round(engine, tok, 1)
    newer = copy.deepcopy(model)
    with torch.no_grad():
        for p in newer.parameters():
            p.mul_(0.9)
    path = str(tmp_path_factory.mktemp("newer"))
    save_policy(newer, tok, path)
    engine.load_weights(path, policy_version=1)
    second = _round(engine, tok, 2, _through_parquet(first.carry_rows))
    return first, second


def test_a_full_batch_stops_its_stragglers_and_carries_them(rounds):
    first, _ = rounds
    s = first.stats
    assert s["rollout/groups_trainable"] >= 3 and s["rollout/carried_out_partial_samples"] > 0
    assert s["rollout/carried_out_tokens"] == sum(
        len(r.completion_token_ids) for r in first.carry_rows if r.carry_state == "partial"
    )
    for r in first.carry_rows:
        if r.carry_state == "partial":
            assert r.finish_reason == "abort" and r.reward is None and len(r.completion_token_ids) < ROLLOUT.max_tokens
            assert len(r.rollout_logprobs) == len(r.token_policy_versions) == len(r.completion_token_ids)
    # stored groups are complete
    assert all(r.finish_reason in ("stop", "length") and r.outcome for r in first.rows)
    # Parquet takes both kinds of rows as they are.
    assert rows_to_table(first.rows).num_rows == len(first.rows) and rows_to_table(first.carry_rows).num_rows == len(
        first.carry_rows
    )


def test_the_next_round_resumes_them_first_and_stores_them_once(rounds):
    first, second = rounds
    carried = {(r.group_id, r.sample_index) for r in first.carry_rows}
    stored_first = {(r.group_id, r.sample_index) for r in first.rows}
    stored_second = {(r.group_id, r.sample_index): r for r in second.rows}
    assert carried.isdisjoint(stored_first)
    later = set(stored_second) | {(r.group_id, r.sample_index) for r in second.carry_rows}
    assert carried <= later  # every carried sample is finished (stored) or carried again: none lost
    assert second.stats["rollout/carried_in_groups"] == len({g for g, _ in carried})
    spanning = [r for r in second.rows if len(set(r.token_policy_versions)) > 1]
    assert spanning and second.stats["rollout/samples_spanning_versions"] == len(spanning)
    before = {(r.group_id, r.sample_index): r for r in first.carry_rows}
    for r in spanning:
        prefix = before[(r.group_id, r.sample_index)]
        k = len(prefix.completion_token_ids)
        assert r.group_id.startswith("r1-") and r.round == 2  # started in round 1, stored with round 2
        assert r.token_policy_versions == [0] * k + [1] * (len(r.completion_token_ids) - k)
        assert r.completion_token_ids[:k] == prefix.completion_token_ids
        assert r.rollout_logprobs[:k] == pytest.approx(prefix.rollout_logprobs)
        assert r.gen_latency_s >= prefix.gen_latency_s


def test_without_partial_rollouts_stragglers_run_to_the_end(tiny_policy_dir):
    model, tok = load_policy(tiny_policy_dir)
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=ROLLOUT.max_batch)
    result = _round(engine, tok, 1, rollout=ROLLOUT.model_copy(update={"partial_rollouts": False}))
    assert result.carry_rows == [] and result.stats["rollout/carried_out_partial_samples"] == 0
    # in-flight groups finished (batch_full later)
    assert result.stats["rollout/groups"] > result.stats["rollout/target_groups"]


def test_a_synchronous_barrier_generates_whole_batches_of_the_target(tiny_policy_dir):
    model, tok = load_policy(tiny_policy_dir)
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=ROLLOUT.max_batch)
    rollout = ROLLOUT.model_copy(update={"collection": "sync_barrier"})  # partial_rollouts does not apply
    result = _round(engine, tok, 1, rollout=rollout)
    s = result.stats
    assert result.carry_rows == [] and s["rollout/groups_trainable"] >= 3
    # every group keeps every sample: whole batches of target_groups (3), generated and verified to the end
    assert s["rollout/groups"] % 3 == 0 and len(result.rows) == 4 * s["rollout/groups"]
    assert all(r.outcome and r.finish_reason in ("stop", "length") for r in result.rows)


def test_a_verifier_pool_too_small_for_the_engine_shows_as_queue_wait(tiny_policy_dir):
    model, tok = load_policy(tiny_policy_dir)
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=ROLLOUT.max_batch)
    delay = {"median_latency_s": 0.01, "p99_over_median": 1.0}  # every call waits exactly 10 ms
    waits = {}
    for workers in (1, 64):
        verify = VerifyConfig(workers=workers, simulated_environment=delay)
        result = RolloutCollection(
            engine,
            tok,
            prompts=PromptsConfig(),
            rollout=ROLLOUT,
            verify=verify,
            filtering=FILTER,
            target_groups=3,
            seed=7,
            run_id="t",
            round_index=1,
        ).collect()
        waits[workers] = result.stats["verify/queue_wait_p90_s"]
        assert result.stats["verify/env_latency_p50_s"] == pytest.approx(0.01, abs=0.005)
    # one worker verifies 100 samples a second, far fewer than the engine finishes: they queue for it
    assert waits[1] > 0.05 and waits[64] < waits[1] / 5, waits
