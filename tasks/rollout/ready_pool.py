"""The ready pool: groups in, trainable groups out, and the round stops the moment it has enough.

One round's collection, as an object the rollout stage drives:

    pool = ReadyPool(submit, decode, is_trainable, target_groups, PoolLimits(...))
    pool.carry_in(carried)                                   # last round's unfinished groups, resumed first
    for sample in engine.generate(pool.feed(fresh, max_fresh), pool.should_stop):
        pool.on_sample(sample)                               # finished samples go to the verifier at once
    harvest = pool.finish()                                  # ready groups + the carry-over

- Feeding is lazy and over-provisioned: the engine pulls groups as it has room, carried groups first,
  then fresh ones (at most ``max_fresh``), and feeding ends once the target is reached.
- A finished sample is verified while the others still generate; at most ``max_outstanding``
  verifications are in flight, the rest wait here (so a round that ends leaves little environment
  work behind, and what it leaves is carried, not lost). Once the environment proves slow, feeding
  holds while as many samples wait for a verifier as it has in flight: generation does not outrun the
  environment, so neither the queue nor the carry-over grows from round to round.
- A group is ready when every one of its samples is finished and verified; it counts toward the
  target when it would survive filtering (``is_trainable(group)``, called once all its verdicts are in).
- ``feed_batch`` and ``drain`` instead give a synchronous barrier (generate a fixed batch, wait for every
  sample and verdict, repeat while short of the target): the way most trainers collect, kept as the
  baseline the ready pool is measured against (rollout.collection, benchmarks/batch_collection.py).
- With ``stop_in_flight`` the engine is told to stop (``should_stop``) once the target is reached, or
  (``stop_at_cap_below``) once a round short of its target has fed all it may and only its tail is
  still generating; its unfinished samples come back partial and are carried over with their
  prefixes, as are finished samples still waiting on the environment. Without it, samples in flight
  run to the end.

Determinism. The stop decision depends on verdicts, which arrive on other threads. While the
environment answers within ``verdict_wait_s``, the pool waits for the verdicts of every generated
group whenever they could change the decision, so the stop point (and so every row and prefix) is a
function of the generated samples alone. A verdict that does not come within ``verdict_wait_s`` turns
that off for the rest of the round: a slow environment is never waited for again, and the stop point
then depends on its timing, as it must.

Every group handed to the engine ends in exactly one of ``harvest.ready`` and ``harvest.carry``, and
every sample of a carried group is either finished (with or without its verdict) or partial.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from models.engines.types import GeneratedSample, GroupRequest, unstarted

PARTIAL, UNVERIFIED, VERIFIED = "partial", "unverified", "verified"  # a carried sample's state


@dataclass
class Slot:
    """One sample of a group: finished (``sample`` set, not partial), with its verdict once verified."""

    index: int
    sample: GeneratedSample | None = None
    text: str | None = None
    verdict: Any = None
    verified_at: float | None = None
    carried_partial: GeneratedSample | None = None  # a prefix to resume (or the one it was stopped with)

    @property
    def finished(self) -> bool:
        return self.sample is not None and not self.sample.partial

    @property
    def state(self) -> str:
        return VERIFIED if self.verdict is not None else UNVERIFIED if self.finished else PARTIAL


@dataclass
class Group:
    """One prompt x n samples, as the pool tracks it. ``meta`` is the caller's (the prompt record)."""

    request: GroupRequest
    reference: str
    meta: Any
    enqueued_at: float
    slots: list[Slot] = field(default_factory=list)
    generated_seq: int | None = None  # order in which its last sample finished (the rows' order)
    carried: bool = False

    def __post_init__(self) -> None:
        if not self.slots:
            self.slots = [Slot(i) for i in range(self.request.n)]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.slots)

    @property
    def verified(self) -> bool:
        return all(s.verdict is not None for s in self.slots)

    def resume_request(self) -> GroupRequest | None:
        """The engine request for this group's unfinished samples, or None when all are finished."""
        todo = [
            s.carried_partial or unstarted(self.request, s.index, time.time()) for s in self.slots if not s.finished
        ]
        if not todo:
            return None
        return GroupRequest(
            self.request.group_id, self.request.prompt_token_ids, self.request.n, self.request.sampling, tuple(todo)
        )


@dataclass(frozen=True)
class PoolLimits:
    max_outstanding: int = 4
    """Verifications in flight at once; more finished samples wait in the pool."""
    verdict_wait_s: float = 0.1
    """How long a decision may wait for verdicts before the environment counts as slow (see module doc)."""
    stop_in_flight: bool = True
    """Stop the engine's unfinished samples once the target is reached, and carry them over."""
    stop_at_cap_below: int | None = None
    """With ``stop_in_flight``: a round that has fed every fresh group it may (the over-provisioning cap)
    without reaching its target stops too, once at most this many samples are still generating (the
    engine's refill point: its batch is half empty and nothing is left to fill it). Past the cap nothing
    in flight can bring in more than it will next round, when it is resumed. None: they run to the end."""


@dataclass(kw_only=True)
class Harvest:
    ready: list[Group]  # every sample finished and verified, in the order the groups finished generating
    carry: list[Group]  # the rest: partial samples, and finished samples still waiting on the environment
    trainable: int
    batch_ready_at: float | None  # when the pool first held the target number of trainable groups
    stopped_at: float | None  # when the engine was told to stop
    abandoned: int  # verifications left running (their samples are carried and verified again later)
    waited_for_slow_environment: bool  # False: the stop point was decided by generated samples alone


class ReadyPool:
    def __init__(
        self,
        submit: Callable[[str, str], Future],
        decode: Callable[[list[int]], str],
        is_trainable: Callable[[Group], bool],
        target_groups: int,
        limits: PoolLimits = PoolLimits(),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._submit, self._decode, self._is_trainable = submit, decode, is_trainable
        self.target = target_groups
        self.limits = limits
        self._clock = clock
        self.groups: dict[str, Group] = {}  # every group handed to the engine (or carried in), in order
        self._carried: list[Group] = []
        self._backlog: deque[tuple[Group, Slot]] = deque()  # finished samples waiting for a verifier
        self._outstanding: dict[Future, tuple[Group, Slot]] = {}
        # verdicts land here from the verifier threads as they finish (deque appends are thread-safe),
        # so reading them costs one pop each instead of polling every outstanding future per sample;
        # the same callback sets _landed, which is all a wait for a verdict blocks on (waiting on the
        # futures themselves installs a waiter on each of up to max_outstanding futures per wait,
        # bookkeeping that took a large share of a late long-tail round: docs/performance.md)
        self._arrived: deque[Future] = deque()
        self._landed = threading.Event()
        self._finished = False
        self._unresolved: dict[str, Group] = {}  # generated groups without every verdict
        self._generated = 0
        self.trainable = 0
        self.batch_ready_at: float | None = None
        self.stopped_at: float | None = None
        self.fed_all = False  # feed gave every fresh group it may: the cap, or the end of the stream
        self._generating = 0  # samples handed to the engine and not yet returned (finished or partial)
        self._finished_here = 0  # samples the engine finished in this round
        self._patient = limits.verdict_wait_s > 0

    # -- feeding -----------------------------------------------------------------------------------

    def carry_in(self, groups: Iterable[Group]) -> None:
        """Last round's unfinished groups: their finished-but-unverified samples go to the verifier
        now, their partial samples are resumed first by ``feed``."""
        for group in groups:
            group.carried, group.generated_seq = True, None
            self.groups[group.request.group_id] = group
            self._carried.append(group)
            for slot in group.slots:
                if slot.finished and slot.verdict is None:
                    self._backlog.append((group, slot))
            self._check_generated(group)
        self._collect()

    def feed(self, fresh: Iterable[Group], max_fresh: int) -> Iterator[GroupRequest]:
        """Carried groups' unfinished samples, then fresh groups until the target is reached, ``max_fresh``
        groups are fed (the over-provisioning cap) or ``fresh`` ends. Past the cap, nothing the engine
        still holds can bring in more than it would bring next round, so with ``stop_in_flight`` the round
        stops there too instead of waiting for its slowest sample (``should_stop``)."""
        for group in self._carried:
            request = group.resume_request()
            if request is not None:
                self._generating += len(request.resume)
                yield request
        count = 0
        for group in fresh:
            if count >= max_fresh:
                break
            if self.batch_full():
                return
            self._hold_for_environment()
            if self.batch_full():
                return
            count += 1
            self.groups[group.request.group_id] = group
            self._generating += group.request.n
            yield group.request
        self.fed_all = True

    def feed_batch(self, batch: Iterable[Group]) -> Iterator[GroupRequest]:
        """A synchronous barrier's batch: carried groups' unfinished samples (the first time only), then
        every group of ``batch``, whether or not the target is reached meanwhile. ``drain`` then waits
        for every verdict before the caller decides whether to generate another batch."""
        carried, self._carried = self._carried, []
        for group in carried:
            request = group.resume_request()
            if request is not None:
                self._generating += len(request.resume)
                yield request
        for group in batch:
            self.groups[group.request.group_id] = group
            self._generating += group.request.n
            yield group.request

    def drain(self) -> None:
        """Wait for the verdict of every finished sample (the barrier)."""
        self._collect()
        while self._backlog or self._outstanding:
            self._await_verdict(None)

    def batch_full(self) -> bool:
        """Does the pool hold the target number of trainable groups? (May wait: see module doc.)"""
        self._collect()
        if self.trainable < self.target and self._patient and self.trainable + len(self._unresolved) >= self.target:
            self._wait(lambda: self.trainable >= self.target or not self._unresolved)
        return self.trainable >= self.target

    def should_stop(self) -> bool:
        """Polled by the engine before each step: stop the samples still generating? Yes, with
        ``stop_in_flight``, once the batch is full or every group the round may feed has been fed."""
        if self.stopped_at is None and self.limits.stop_in_flight and (self._tail_at_cap() or self.batch_full()):
            self.stopped_at = self._clock()
        return self.stopped_at is not None

    def _tail_at_cap(self) -> bool:
        """Every fresh group is fed, what still generates is the round's tail (at most
        ``stop_at_cap_below`` samples, and no more than have already finished this round, so a round
        whose whole feed fits in the engine at once still runs), and the round holds a trainable group.
        A round with none runs its tail out: stopped, it would end with nothing to train on (seen with
        verdicts from a Ray cluster still on their way when the tail was reached)."""
        below = self.limits.stop_at_cap_below
        return (
            self.fed_all
            and below is not None
            and self.trainable > 0
            and self._generating <= below
            and self._generating <= self._finished_here
        )

    # -- samples -----------------------------------------------------------------------------------

    def on_sample(self, sample: GeneratedSample) -> None:
        group = self.groups.get(sample.group_id)
        if group is None:
            raise KeyError(f"the engine returned a sample of group {sample.group_id}, which this pool never fed")
        slot = group.slots[sample.sample_index]
        if slot.finished:
            raise ValueError(f"sample {sample.group_id}/{sample.sample_index} was returned twice")
        self._generating -= 1
        if sample.partial:
            slot.carried_partial = sample
        else:
            slot.sample, slot.carried_partial = sample, None
            self._finished_here += 1
            slot.text = self._decode(sample.token_ids)
            self._backlog.append((group, slot))
            self._check_generated(group)
        self._collect()

    def finish(self) -> Harvest:
        """Close the round's collection. After a stop, verdicts still out are waited for only while the
        environment counts as fast; otherwise (no stop: the target was not reached, or samples ran to
        the end) every verdict is waited for."""
        now = self._clock()
        for group in self.groups.values():  # an engine that ended without answering for a sample: keep it
            for slot in group.slots:
                if not slot.finished and slot.carried_partial is None:
                    slot.carried_partial = unstarted(group.request, slot.index, now)
        if self.stopped_at is None:
            self.drain()
        elif self._patient:
            self._wait(lambda: not self._backlog and not self._outstanding)
        self._collect()
        self._finished = True
        ready = sorted((g for g in self.groups.values() if g.verified), key=lambda g: g.generated_seq)
        carry = [g for g in self.groups.values() if not g.verified]
        for group in carry:  # their verdicts are not read any more: they are verified again when carried in
            for slot in group.slots:
                if slot.verdict is None:
                    slot.verified_at = None
        return Harvest(
            ready=ready,
            carry=carry,
            trainable=self.trainable,
            batch_ready_at=self.batch_ready_at,
            stopped_at=self.stopped_at,
            abandoned=len(self._outstanding),
            waited_for_slow_environment=not self._patient,
        )

    # -- internals ---------------------------------------------------------------------------------

    def _check_generated(self, group: Group) -> None:
        if group.generated_seq is None and group.finished:
            group.generated_seq = self._generated
            self._generated += 1
            self._unresolved[group.request.group_id] = group
            self._resolve(group)

    def _pump(self) -> None:
        while self._backlog and len(self._outstanding) < self.limits.max_outstanding:
            group, slot = self._backlog.popleft()
            future = self._submit(slot.text or "", group.reference)
            self._outstanding[future] = (group, slot)
            future.add_done_callback(lambda f, s=slot: self._land(f, s))

    def _land(self, future: Future, slot: Slot) -> None:
        """A verdict's callback, on the thread that resolved it: time it, queue it, wake a waiter. The
        queue is filled before the wake-up, so a woken waiter always finds what woke it. A verdict that
        lands after ``finish`` is not read: its sample was carried, to be verified again."""
        if self._finished:
            return
        slot.verified_at = self._clock()
        self._arrived.append(future)
        self._landed.set()

    def _await_verdict(self, timeout: float | None) -> None:
        """Block until a verdict lands (at most ``timeout`` seconds; None: until one does), then read
        whatever has. The event is cleared before the queue is read: a verdict landing after the read
        sets it again, so it is never slept through."""
        if self._outstanding:
            self._landed.wait(timeout)
        self._landed.clear()
        self._collect()

    def _collect(self) -> None:
        """Read the verdicts that have arrived, hand waiting samples to the verifier, count ready groups."""
        while True:
            arrived = 0
            while self._arrived:
                future = self._arrived.popleft()
                group, slot = self._outstanding.pop(future)
                slot.verdict = future.result()
                self._resolve(group)
                arrived += 1
            self._pump()
            if not arrived:
                return

    def _resolve(self, group: Group) -> None:
        if group.request.group_id in self._unresolved and group.verified:
            del self._unresolved[group.request.group_id]
            if self._is_trainable(group):
                self.trainable += 1
                if self.trainable == self.target:
                    self.batch_ready_at = self._clock()

    def _hold_for_environment(self) -> None:
        """Backpressure: once the environment is slow, a fresh group waits while more finished samples
        queue for a verifier than it has in flight. Generating on would only lengthen that queue, and
        what is still queued when the batch fills is carried over and verified again next round: a
        carry-over that grows round after round while the rows trained on grow ever older (on the long-tail
        preset learning stopped: docs/performance.md). The engine's samples
        in flight keep decoding only as far as its next refill, which is where it asks for this group.
        While the environment keeps up (the pool is patient) this never waits, so rows stay reproducible."""
        while not self._patient and len(self._backlog) >= self.limits.max_outstanding and self._outstanding:
            self._await_verdict(0.05)

    def _wait(self, until: Callable[[], bool]) -> None:
        """Wait for verdicts until ``until()`` holds; past ``verdict_wait_s`` the environment is slow."""
        deadline = time.monotonic() + self.limits.verdict_wait_s
        self._collect()
        while not until():
            left = deadline - time.monotonic()
            if left <= 0 or not self._outstanding:
                self._patient = False
                return
            self._await_verdict(left)
