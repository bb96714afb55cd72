"""The ready pool, driven by a scripted engine and a scripted environment (test doubles of the engine
and verifier interfaces): feeding stops at the target, groups are ready only when all their samples
are verified, unfinished work is carried over and resumed with its versions, nothing is lost."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from models.engines.types import ABORT, GeneratedSample, GroupRequest, SamplingParams, unstarted
from tasks.rollout.ready_pool import PARTIAL, UNVERIFIED, VERIFIED, Group, PoolLimits, ReadyPool


@dataclass(frozen=True)
class Verdict:
    reward: float


class ScriptedEngine:
    """Generates one token per step for every admitted sample; sample (g, i) is ``lengths[g][i]`` tokens
    long. Token t of a sample is t, its logprob -(t + 1) / 10; versions are the engine's policy version.
    Admits samples while it has room, like the embedded engine, and honours should_stop the same way."""

    def __init__(self, lengths: dict[str, list[int]], max_batch: int = 4, policy_version: int = 0):
        self.lengths, self.max_batch, self.policy_version = lengths, max_batch, policy_version
        self.requests: list[GroupRequest] = []
        self.steps = 0

    def generate(self, groups, should_stop=None):
        feed, running, waiting = iter(groups), [], []
        while True:
            if should_stop is not None and should_stop():
                now = time.time()
                for s in running + waiting:
                    yield GeneratedSample(
                        group_id=s.group_id,
                        sample_index=s.sample_index,
                        prompt_token_ids=s.prompt_token_ids,
                        token_ids=s.token_ids,
                        logprobs=s.logprobs,
                        token_policy_versions=s.token_policy_versions,
                        finish_reason=ABORT,
                        started_at=s.started_at,
                        finished_at=now,
                    )
                return
            while len(running) + len(waiting) < self.max_batch:
                group = next(feed, None)
                if group is None:
                    break
                self.requests.append(group)
                for i in group.sample_indices():
                    base = unstarted(group, i, time.time())
                    waiting.append(
                        GeneratedSample(
                            group_id=base.group_id,
                            sample_index=i,
                            prompt_token_ids=base.prompt_token_ids,
                            token_ids=list(base.token_ids),
                            logprobs=list(base.logprobs),
                            token_policy_versions=list(base.token_policy_versions),
                            finish_reason=ABORT,
                            started_at=base.started_at,
                            finished_at=base.finished_at,
                        )
                    )
            running, waiting = (
                running + waiting[: self.max_batch - len(running)],
                waiting[self.max_batch - len(running) :],
            )
            if not running:
                return
            self.steps += 1
            still = []
            for s in running:
                t = len(s.token_ids)
                s.token_ids.append(t)
                s.logprobs.append(-(t + 1) / 10)
                s.token_policy_versions.append(self.policy_version)
                if len(s.token_ids) >= self.lengths[s.group_id][s.sample_index]:
                    s.finish_reason, s.finished_at = "length", time.time()
                    yield s
                else:
                    still.append(s)
            running = still


class ScriptedEnvironment:
    """Reward 1 for even sample lengths, 0 for odd ones (so a group with both is trainable). Verdicts of
    groups in ``held`` wait until ``release()``; with ``jitter_s`` the others arrive from a thread after
    a random delay, as a real verifier pool's would."""

    def __init__(self, held: set[str] = frozenset(), jitter_s: float = 0.0, seed: int = 0):
        self.held, self.jitter_s, self.rng = set(held), jitter_s, random.Random(seed)
        self.waiting: list[tuple[Future, Verdict]] = []
        self.calls: list[str] = []

    def submit(self, text: str, reference: str) -> Future:
        future: Future = Future()
        verdict = Verdict(float(int(text) % 2 == 0))
        self.calls.append(reference)
        if reference in self.held:
            self.waiting.append((future, verdict))
        elif self.jitter_s:
            threading.Timer(self.rng.uniform(0, self.jitter_s), future.set_result, (verdict,)).start()
        else:
            future.set_result(verdict)
        return future

    def release(self) -> None:
        for future, verdict in self.waiting:
            future.set_result(verdict)
        self.waiting.clear()


def trainable(group: Group) -> bool:
    return len({s.verdict.reward for s in group.slots}) > 1


def group(group_id: str, n: int = 2) -> Group:
    request = GroupRequest(group_id, (1, 2), n, SamplingParams(max_tokens=16))
    return Group(request, reference=group_id, meta=None, enqueued_at=time.time())


QUICK = PoolLimits(verdict_wait_s=0.05)


def collect(engine, env, lengths, target, fresh_ids, carried=(), limits=QUICK, max_fresh=None):
    pool = ReadyPool(env.submit, lambda ids: str(len(ids)), trainable, target, limits)
    pool.carry_in(carried)
    fresh = (group(g, len(lengths[g])) for g in fresh_ids)
    for sample in engine.generate(
        pool.feed(fresh, len(fresh_ids) if max_fresh is None else max_fresh), pool.should_stop
    ):
        pool.on_sample(sample)
    assert pool._generating == 0  # the engine answered for every sample it was handed, carried ones too
    return pool, pool.finish()


def accounted(harvest) -> dict[tuple[str, int], str]:
    """Every sample of every group the pool handed out, with where it ended up."""
    out = {}
    for g in harvest.ready:
        for s in g.slots:
            assert s.finished and s.verdict is not None
            out[(g.request.group_id, s.index)] = "ready"
    for g in harvest.carry:
        for s in g.slots:
            assert (s.finished and s.carried_partial is None) or (not s.finished and s.carried_partial.partial)
            out[(g.request.group_id, s.index)] = s.state
    return out


def test_feeding_stops_at_the_target():
    lengths = {f"g{i}": [2, 3] for i in range(10)}  # every group trainable, each complete after 3 tokens
    engine = ScriptedEngine(lengths, max_batch=4)  # two groups at a time
    pool, harvest = collect(engine, ScriptedEnvironment(), lengths, target=2, fresh_ids=list(lengths))
    # g2 took the slots g0 and g1 freed at step 2, before the target was reached; then nothing more.
    assert [r.group_id for r in engine.requests] == ["g0", "g1", "g2"] and engine.steps == 3
    assert [g.request.group_id for g in harvest.ready] == ["g0", "g1"]
    # g2, stopped at 1 token
    assert [[s.carried_partial.token_ids for s in g.slots] for g in harvest.carry] == [[[0], [0]]]
    assert harvest.trainable == 2 and harvest.batch_ready_at is not None and harvest.stopped_at is not None


def test_over_provisioning_feeds_past_untrainable_groups_up_to_the_cap():
    lengths = {**{f"g{i}": [2, 2] for i in range(3)}, "g3": [2, 3], "g4": [2, 3]}  # g0-g2 score the same: untrainable
    engine = ScriptedEngine(lengths, max_batch=2)  # one group at a time
    _, harvest = collect(engine, ScriptedEnvironment(), lengths, target=1, fresh_ids=list(lengths))
    # g4 took the slot g3's short sample freed; g3 then filled the batch and g4 was stopped.
    assert [r.group_id for r in engine.requests] == ["g0", "g1", "g2", "g3", "g4"]
    assert harvest.trainable == 1 and [g.request.group_id for g in harvest.ready] == ["g0", "g1", "g2", "g3"]
    assert [g.request.group_id for g in harvest.carry] == ["g4"]
    engine = ScriptedEngine(lengths, max_batch=2)
    _, capped = collect(engine, ScriptedEnvironment(), lengths, target=1, fresh_ids=list(lengths), max_fresh=2)
    assert [r.group_id for r in engine.requests] == ["g0", "g1"] and capped.trainable == 0 and capped.stopped_at is None


def test_a_round_short_of_its_target_at_the_cap_stops_at_its_tail():
    # the target (5) is out of reach, g2 is the round's one trainable group; g3's second sample is its straggler
    lengths = {"g0": [2, 2], "g1": [2, 2], "g2": [2, 3], "g3": [2, 30]}
    limits = PoolLimits(verdict_wait_s=0.05, stop_at_cap_below=2)
    engine = ScriptedEngine(lengths, max_batch=4)
    _, harvest = collect(engine, ScriptedEnvironment(), lengths, target=5, fresh_ids=list(lengths), limits=limits)
    # g2 and g3 took g0's and g1's slots at step 2; nothing was left to feed, and once g2 was complete
    # (step 6) one sample still generated: it was stopped at the next poll, not at its thirtieth token
    assert engine.steps == 6 and harvest.stopped_at is not None and harvest.batch_ready_at is None
    assert [g.request.group_id for g in harvest.ready] == ["g0", "g1", "g2"]
    (carried,) = harvest.carry
    assert [s.state for s in carried.slots] == [VERIFIED, PARTIAL]
    assert len(carried.slots[1].carried_partial.token_ids) == 4
    # without the setting (or without partial rollouts) the straggler runs to its end
    engine = ScriptedEngine(lengths, max_batch=4)
    _, waited = collect(engine, ScriptedEnvironment(), lengths, target=5, fresh_ids=list(lengths))
    assert engine.steps == 2 + 30 and waited.carry == [] and waited.stopped_at is None


def test_a_round_whose_whole_feed_fits_the_engine_finishes_as_much_as_it_carries():
    lengths = {"g0": [2, 3], "g1": [4, 30], "g2": [5, 30], "g3": [6, 30]}
    limits = PoolLimits(verdict_wait_s=0.05, stop_at_cap_below=8)
    engine = ScriptedEngine(lengths, max_batch=16)
    _, harvest = collect(engine, ScriptedEnvironment(), lengths, target=5, fresh_ids=list(lengths), limits=limits)
    # every sample was in flight from the start, under the tail size, and g0 was trainable at step 3: the
    # round still ran until as many samples had finished as were left generating (step 5)
    assert engine.steps == 5
    assert [g.request.group_id for g in harvest.ready] == ["g0"]
    assert accounted(harvest) == {
        ("g0", 0): "ready",
        ("g0", 1): "ready",
        ("g1", 0): VERIFIED,
        ("g1", 1): PARTIAL,
        ("g2", 0): VERIFIED,
        ("g2", 1): PARTIAL,
        ("g3", 0): PARTIAL,
        ("g3", 1): PARTIAL,
    }


def test_a_round_with_nothing_trainable_at_the_cap_runs_its_tail_out():
    # nothing can stop short of a trainable group: stopped, the round would have nothing to train on
    lengths = {"g0": [2, 2], "g1": [2, 2], "g2": [2, 2], "g3": [2, 30]}
    limits = PoolLimits(verdict_wait_s=0.05, stop_at_cap_below=2)
    engine = ScriptedEngine(lengths, max_batch=4)
    _, harvest = collect(engine, ScriptedEnvironment(), lengths, target=5, fresh_ids=list(lengths), limits=limits)
    assert engine.steps == 2 + 30 and harvest.stopped_at is None and harvest.carry == []
    assert harvest.trainable == 0 and [g.request.group_id for g in harvest.ready] == ["g0", "g1", "g2", "g3"]


def test_a_group_is_ready_only_when_all_its_samples_are_verified_and_stragglers_are_stopped():
    lengths = {"g0": [2, 9], "g1": [3, 4]}
    engine = ScriptedEngine(lengths, max_batch=4)
    _, harvest = collect(engine, ScriptedEnvironment(), lengths, target=1, fresh_ids=["g0", "g1"])
    assert [g.request.group_id for g in harvest.ready] == ["g1"]  # g0 started first but is not complete
    assert engine.steps == 4  # stopped once g1 was verified, not at g0's ninth token
    (carried,) = harvest.carry
    assert [s.state for s in carried.slots] == [VERIFIED, PARTIAL]
    assert carried.slots[1].carried_partial.token_ids == [0, 1, 2, 3]
    assert accounted(harvest) == {("g0", 0): VERIFIED, ("g0", 1): PARTIAL, ("g1", 0): "ready", ("g1", 1): "ready"}


def test_carried_samples_resume_first_under_the_new_version():
    lengths = {"g0": [2, 9], "g1": [3, 4], "g2": [8, 7]}
    _, first = collect(
        ScriptedEngine(lengths, max_batch=4), ScriptedEnvironment(), lengths, target=1, fresh_ids=["g0", "g1"]
    )
    engine = ScriptedEngine(lengths, max_batch=4, policy_version=1)
    env = ScriptedEnvironment()
    _, second = collect(engine, env, lengths, target=2, fresh_ids=["g2"], carried=first.carry)
    assert [r.group_id for r in engine.requests] == ["g0", "g2"]  # the carried group first
    assert [s.sample_index for s in engine.requests[0].resume] == [1]  # only its unfinished sample
    assert [g.request.group_id for g in second.ready] == ["g0", "g2"] and second.carry == []
    g0 = second.ready[0]
    assert g0.slots[0].sample.token_policy_versions == [0, 0]  # finished and verified last round: not redone
    assert g0.slots[1].sample.token_policy_versions == [0] * 4 + [1] * 5  # the version changes where it stopped
    assert g0.slots[1].sample.token_ids == list(range(9)) and g0.slots[1].sample.logprobs == [
        -(t + 1) / 10 for t in range(9)
    ]
    assert env.calls == ["g0", "g2", "g2"]  # only the resumed sample of g0 is verified again


def test_samples_waiting_on_a_slow_environment_are_carried_not_lost():
    lengths = {"g0": [2, 3], "g1": [2, 3]}
    env = ScriptedEnvironment(held={"g1"})
    _, first = collect(
        ScriptedEngine(lengths), env, lengths, target=1, fresh_ids=["g0", "g1"], limits=PoolLimits(verdict_wait_s=0.01)
    )
    assert [g.request.group_id for g in first.ready] == ["g0"] and first.abandoned == 2
    assert [s.state for s in first.carry[0].slots] == [UNVERIFIED, UNVERIFIED]  # generated, verdicts still out
    assert first.waited_for_slow_environment
    env.release()  # the old verdicts arrive after the round ended: nobody reads them
    engine = ScriptedEngine(lengths, policy_version=1)
    _, second = collect(engine, ScriptedEnvironment(), lengths, target=1, fresh_ids=[], carried=first.carry)
    assert engine.requests == []  # verified again, never generated again
    assert [g.request.group_id for g in second.ready] == ["g1"] and second.trainable == 1
    assert second.ready[0].slots[1].sample.token_policy_versions == [0, 0, 0]


def test_without_stopping_in_flight_samples_run_to_the_end():
    lengths = {"g0": [2, 9], "g1": [3, 4], "g2": [3, 4]}
    engine = ScriptedEngine(lengths, max_batch=4)
    _, harvest = collect(
        engine,
        ScriptedEnvironment(),
        lengths,
        target=1,
        fresh_ids=list(lengths),
        limits=PoolLimits(stop_in_flight=False),
    )
    # g2 fed at step 3; none after the target (step 4)
    assert [r.group_id for r in engine.requests] == ["g0", "g1", "g2"]
    assert [g.request.group_id for g in harvest.ready] == ["g1", "g2", "g0"]  # in the order they finished
    assert harvest.carry == [] and harvest.stopped_at is None and engine.steps == 9


@pytest.mark.parametrize("jitter_s", [0.0, 0.002, 0.01])
def test_the_stop_point_does_not_depend_on_when_fast_verdicts_arrive(jitter_s):
    rng = random.Random(3)
    lengths = {f"g{i}": [rng.randint(1, 12) for _ in range(4)] for i in range(12)}
    engine = ScriptedEngine(lengths, max_batch=8)
    _, harvest = collect(
        engine,
        ScriptedEnvironment(jitter_s=jitter_s),
        lengths,
        target=3,
        fresh_ids=list(lengths),
        limits=PoolLimits(verdict_wait_s=1.0, max_outstanding=3),
    )
    summary = (
        [g.request.group_id for g in harvest.ready],
        {
            (g.request.group_id, s.index): (s.state, len((s.sample or s.carried_partial).token_ids))
            for g in harvest.carry
            for s in g.slots
        },
    )
    reference_engine = ScriptedEngine(lengths, max_batch=8)
    _, reference = collect(reference_engine, ScriptedEnvironment(), lengths, target=3, fresh_ids=list(lengths))
    expected = (
        [g.request.group_id for g in reference.ready],
        {
            (g.request.group_id, s.index): (s.state, len((s.sample or s.carried_partial).token_ids))
            for g in reference.carry
            for s in g.slots
        },
    )
    assert summary == expected and engine.steps == reference_engine.steps
    assert not harvest.waited_for_slow_environment and harvest.trainable >= 3


def test_nothing_is_lost_when_the_round_ends():
    rng = random.Random(8)
    lengths = {f"g{i}": [rng.randint(1, 15) for _ in range(3)] for i in range(20)}
    engine = ScriptedEngine(lengths, max_batch=10)
    pool, harvest = collect(
        engine,
        ScriptedEnvironment(held={"g5"}),
        lengths,
        target=4,
        fresh_ids=list(lengths),
        limits=PoolLimits(verdict_wait_s=0.01),
    )
    fed = {(r.group_id, i) for r in engine.requests for i in r.sample_indices()}
    assert set(accounted(harvest)) == fed  # every sample handed out is ready or carried, once
    assert {g.request.group_id for g in harvest.ready}.isdisjoint(g.request.group_id for g in harvest.carry)
    assert sum(len(g.slots) for g in harvest.ready + harvest.carry) == len(fed)


def test_a_synchronous_barrier_generates_whole_batches_and_waits_for_every_verdict():
    # batch 1: g0, g1 (g0 untrainable); batch 2: g2, g3; the target (2) is met by g2, yet g3 runs to the end
    lengths = {"g0": [2, 2], "g1": [2, 3], "g2": [4, 5], "g3": [2, 31], "g4": [2, 3]}
    engine = ScriptedEngine(lengths, max_batch=16)
    env = ScriptedEnvironment(jitter_s=0.01)
    pool = ReadyPool(env.submit, lambda ids: str(len(ids)), trainable, 2, PoolLimits(stop_in_flight=False))
    fresh = iter(group(g, 2) for g in lengths)
    batches = 0
    while not pool.batch_full():
        batch = [next(fresh), next(fresh)]
        for sample in engine.generate(pool.feed_batch(batch)):
            pool.on_sample(sample)
        pool.drain()
        batches += 1
        assert all(g.verified for g in pool.groups.values())  # the barrier: nothing left in flight or unverified
    harvest = pool.finish()
    assert batches == 2 and [r.group_id for r in engine.requests] == ["g0", "g1", "g2", "g3"]
    assert [g.request.group_id for g in harvest.ready] == ["g0", "g1", "g2", "g3"] and harvest.carry == []
    assert harvest.trainable == 3 and harvest.stopped_at is None  # g3 waited for in full: the barrier's cost
    assert engine.steps == 3 + 31  # each batch as long as its longest sample


class SlowEnvironment:
    """One verifier that takes ``seconds`` a verdict, in submission order: an environment the engine outruns.
    Reward as ``ScriptedEnvironment``'s."""

    def __init__(self, seconds: float) -> None:
        import queue

        self.seconds, self.jobs, self.calls = seconds, queue.Queue(), 0
        threading.Thread(target=self._serve, daemon=True).start()

    def submit(self, text: str, reference: str) -> Future:
        future: Future = Future()
        self.calls += 1
        self.jobs.put((future, Verdict(float(int(text) % 2 == 0))))
        return future

    def _serve(self) -> None:
        while True:
            future, verdict = self.jobs.get()
            time.sleep(self.seconds)
            future.set_result(verdict)


def test_feeding_holds_for_a_slow_environment_so_the_carry_over_stays_bounded():
    lengths = {f"g{i:03d}": [2, 3] for i in range(300)}  # every group trainable once both verdicts are in
    limits = PoolLimits(max_outstanding=4, verdict_wait_s=0.01)
    engine = ScriptedEngine(lengths, max_batch=8)
    pool, harvest = collect(engine, SlowEnvironment(0.002), lengths, target=20, fresh_ids=list(lengths), limits=limits)
    assert harvest.trainable >= 20 and harvest.waited_for_slow_environment
    unverified = [s for g in harvest.carry for s in g.slots if s.state == UNVERIFIED]
    # the engine outruns the environment, but at most a queue and the engine's batch more than it needs are
    # generated: without the hold every one of the 300 groups would be fed and carried unverified
    assert len(unverified) <= 2 * limits.max_outstanding + engine.max_batch + 2
    assert len(engine.requests) < 40
    assert set(accounted(harvest)) == {(r.group_id, i) for r in engine.requests for i in range(2)}  # none lost
