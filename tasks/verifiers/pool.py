"""The verifier pool: verify samples on worker threads while the engine keeps generating.

The pool's size is set independently of the rollout engine. It retries infrastructure failures
within a per-round budget and turns everything that goes wrong around a verifier (a dead worker, a
call that never returns, a dead pool) into an ``infra_failure`` verdict, so a round always finishes
and ``verify.max_infra_failure_rate`` decides whether it may train.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, replace

from tasks.verifiers.outcome import Outcome, Verdict, Verifier, VerifierInfraError


class InfraFailureRateError(RuntimeError):
    """A round's share of infrastructure failures passed ``verify.max_infra_failure_rate``."""


def _classified_call(verifier: Verifier, completion_text: str, reference: str) -> tuple[Verdict, bool]:
    """(verdict, retryable): whatever the verifier does, as a timed Verdict."""
    start = time.perf_counter()
    retryable = False
    try:
        verdict = verifier(completion_text, reference)
        if verdict.reward is not None and not math.isfinite(verdict.reward):
            raise VerifierInfraError(f"verifier returned non-finite reward {verdict.reward!r}", retryable=False)
    except VerifierInfraError as exc:
        verdict, retryable = Verdict(None, Outcome.INFRA_FAILURE, f"{exc}"), exc.retryable
    except Exception as exc:  # noqa: BLE001 -- classified, never swallowed silently
        verdict, retryable = Verdict(None, Outcome.INFRA_FAILURE, f"verifier error: {type(exc).__name__}: {exc}"), True
    return replace(verdict, latency_s=time.perf_counter() - start), retryable


def run_verifier(verifier: Verifier, completion_text: str, reference: str) -> Verdict:
    """Call a verifier and classify whatever happens, timing it.

    A verifier bug (any exception other than VerifierInfraError) is also an infrastructure failure:
    the model did nothing wrong. A non-finite reward is a verifier bug too.
    """
    return _classified_call(verifier, completion_text, reference)[0]


def check_infra_failure_rate(stats: dict[str, float], limit: float, round_index: int) -> None:
    """Fail the round loudly, before anything is committed, when the environment failed too often."""
    rate = stats["verify/infra_failure_rate"]
    if rate > limit:
        raise InfraFailureRateError(
            f"round {round_index}: {rate:.1%} of samples failed for infrastructure reasons (limit {limit:.0%}); "
            "fix the verifier environment or raise verify.max_infra_failure_rate"
        )


# -- the pool ------------------------------------------------------------------------------------


@dataclass
class _Job:
    future: Future
    completion_text: str
    reference: str


class _Worker(threading.Thread):
    def __init__(self, pool: VerifierPool, index: int) -> None:
        super().__init__(name=f"verifier-{index}", daemon=True)  # a stuck verifier must not block exit
        self.pool = pool
        self.job: _Job | None = None
        self.since = 0.0  # monotonic start of the current job
        self.abandoned = False  # timed out: the job was failed for it; it exits when the call returns

    def run(self) -> None:
        self.pool._serve(self)


def _resolve(future: Future, verdict: Verdict) -> None:
    try:
        future.set_result(verdict)
    except InvalidStateError:  # already decided (timed out, or the pool died): the first verdict stands
        pass


class VerifierPool:
    """Verifies samples on worker threads while the engine keeps generating.

    Every submitted sample gets a Verdict, whatever goes wrong:
    - an infrastructure failure is retried up to ``retries`` times while the round's ``retry_budget`` lasts;
    - a worker that dies (something escapes the verifier call: SystemExit, a crashed extension) fails
      the sample it held with infra_failure and is replaced, one unit of the budget per replacement;
    - a call that runs past ``timeout_s`` becomes infra_failure; its thread cannot be killed, so it is
      abandoned (daemon) and replaced, one unit of the budget;
    - when no worker is left and the budget is spent, the pool is dead: every queued and every later
      sample is an infra_failure at once, so the round still finishes and the failure-rate gate decides.

    Threads suit verifiers that are cheap or that wait on a subprocess (sandboxes, math workers);
    a verifier that burns Python CPU should start its own process.

    ``inline``: a verifier of a few microseconds that cannot hang (a pure function of the text, such as
    the built-in tasks' exact match) is called on the submitting thread instead, and ``submit`` returns
    a future that is already resolved. Handing such a call to a worker costs more than the call: two
    thread switches and a wait for the interpreter lock that the engine's thread holds. Retries and the
    classification of failures are the same; there is no timeout, since nothing can interrupt the call.
    """

    def __init__(
        self,
        verifier: Verifier,
        workers: int = 2,
        retries: int = 0,
        retry_budget: int = 0,
        timeout_s: float | None = None,
        inline: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError(f"verifier pool needs at least 1 worker, got {workers}")
        if retries < 0 or retry_budget < 0:
            raise ValueError(f"retries ({retries}) and retry_budget ({retry_budget}) must be >= 0")
        self._verifier = verifier
        self._size = workers
        self._retries = retries
        self._budget = retry_budget
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        self._spawned = 0
        self._dead: str | None = None
        self._closing = False
        self._pending = 0  # submitted samples without a verdict yet
        self._settled = threading.Condition(self._lock)
        self.counts: Counter[str] = Counter()
        self.inline = inline
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        if not inline:
            for _ in range(workers):
                self._spawn()
            self._monitor = threading.Thread(target=self._watch, name="verifier-monitor", daemon=True)
            self._monitor.start()

    def submit(self, completion_text: str, reference: str) -> Future:
        """A future that always resolves to a Verdict (never to an exception)."""
        future: Future = Future()
        if self.inline:
            try:
                verdict = self._verify(_Job(future, completion_text, reference))
            except (Exception, SystemExit) as exc:  # noqa: BLE001 -- as a worker's death: the environment's loss
                # Any other BaseException is the process being stopped, not the verifier failing: Ctrl-C, our
                # SIGTERM, or Prefect's TerminationSignal (its SIGTERM handler during a flow run). Swallowed here it
                # would become one infra-failed sample and the campaign would run on past its stop.
                self.counts["deaths"] += 1
                verdict = Verdict(None, Outcome.INFRA_FAILURE, f"verifier call died: {type(exc).__name__}: {exc}")
            _resolve(future, verdict)
            return future
        with self._lock:  # against the monitor declaring the pool dead between the check and the put
            if self._dead is None:
                self._pending += 1
                future.add_done_callback(self._settle)
                self._queue.put(_Job(future, completion_text, reference))
                return future
            reason = self._dead
        _resolve(future, Verdict(None, Outcome.INFRA_FAILURE, f"verifier pool is dead: {reason}"))
        return future

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "verify/infra_retries": self.counts["retries"],
                "verify/infra_recovered": self.counts["recovered"],
                "verify/worker_deaths": self.counts["deaths"],
                "verify/verifier_timeouts": self.counts["timeouts"],
                "verify/workers_replaced": self.counts["replaced"],
                "verify/retry_budget_left": self._budget,
                "verify/pool_dead": float(self._dead is not None),
            }

    def close(self) -> None:
        """Wait for every submitted sample's verdict, then stop the workers and the monitor.

        The wait is bounded by ``timeout_s``: the monitor keeps failing stuck calls while it lasts."""
        with self._settled:
            self._settled.wait_for(lambda: self._pending == 0)
            self._closing = True
            workers = list(self._workers)
        for _ in workers:
            self._queue.put(None)
        for w in workers:
            w.join()
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside the pool -------------------------------------------------------------------------

    def _spawn(self) -> None:
        worker = _Worker(self, self._spawned)
        self._spawned += 1
        self._workers.append(worker)
        worker.start()

    def _settle(self, _future: Future) -> None:
        with self._settled:
            self._pending -= 1
            self._settled.notify_all()

    def _spend(self, what: str) -> bool:
        """Take one unit of the retry budget for ``what``; False when it is spent. Caller holds no lock."""
        with self._lock:
            if self._budget <= 0:
                return False
            self._budget -= 1
            self.counts[what] += 1
            return True

    def _serve(self, worker: _Worker) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                worker.job, worker.since = job, time.monotonic()
            try:
                verdict = self._verify(job)
            except BaseException as exc:  # noqa: BLE001 -- the worker dies; its sample is the environment's loss
                with self._lock:
                    worker.job = None
                    self.counts["deaths"] += 1
                _resolve(
                    job.future,
                    Verdict(None, Outcome.INFRA_FAILURE, f"verifier worker died: {type(exc).__name__}: {exc}"),
                )
                return
            _resolve(job.future, verdict)
            with self._lock:
                worker.job = None
                if worker.abandoned:
                    return

    def _verify(self, job: _Job) -> Verdict:
        attempts, latency = 0, 0.0
        while True:
            attempts += 1
            verdict, retryable = _classified_call(self._verifier, job.completion_text, job.reference)
            latency += verdict.latency_s
            if (
                verdict.outcome != Outcome.INFRA_FAILURE
                or not retryable
                or attempts > self._retries
                or not self._spend("retries")
            ):
                break
        if attempts > 1 and verdict.outcome == Outcome.INFRA_FAILURE:
            verdict = replace(verdict, error=f"{verdict.error} (after {attempts} attempts)")
        elif attempts > 1:
            with self._lock:
                self.counts["recovered"] += 1
        return replace(verdict, latency_s=latency, attempts=attempts)

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            self._check()

    def _check(self) -> None:
        """Time out stuck calls, replace lost workers, and declare the pool dead when none can be."""
        now = time.monotonic()
        failed: list[tuple[Future, str]] = []
        with self._lock:
            for w in self._workers:
                if (
                    w.job is not None
                    and not w.abandoned
                    and self._timeout_s is not None
                    and now - w.since > self._timeout_s
                ):
                    w.abandoned = True
                    self.counts["timeouts"] += 1
                    failed.append((w.job.future, f"verifier gave no verdict within {self._timeout_s:g}s"))
            self._workers = [w for w in self._workers if w.is_alive() and not w.abandoned]
            while len(self._workers) < self._size and self._budget > 0 and self._dead is None and not self._closing:
                self._budget -= 1
                self.counts["replaced"] += 1
                self._spawn()
            if not self._workers and self._dead is None and not self._closing:
                self._dead = "every worker died or hung and the retry budget is spent"
                while True:
                    try:
                        job = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if job is not None:
                        failed.append((job.future, f"verifier pool is dead: {self._dead}"))
        for future, error in failed:
            _resolve(future, Verdict(None, Outcome.INFRA_FAILURE, error))
