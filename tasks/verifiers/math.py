"""Math verifier: is a free-form final answer ("#### 42", "\\boxed{\\frac12}", "1/2") the reference?

Parsing and comparison are math-verify's (LaTeX and plain expressions to SymPy, then numeric and
symbolic equality); this module only decides what each result means for the gradient:

- the reference does not parse           -> VerifierInfraError (the dataset's fault, not the model's);
  references are numbers, plain fractions, or LaTeX ("\\sqrt{2}", "$x+1$"); words never parse;
- the completion has no parseable answer -> model_failure, reward 0.0;
- equal / not equal                      -> success 1.0 / model_failure 0.0;
- the verifier's own deadline expires    -> VerifierInfraError the first time (a loaded machine, a slow
  worker start: the environment's doing, so the pool retries it); when it expires again for the same
  completion and reference, the answer is what makes SymPy hang (``9^{9^{9^9}}``): model_failure,
  reward 0.0, so a policy is penalised for such answers instead of spending the round's retry budget.

Why a worker process: math-verify's timeouts are SIGALRM-based. Off the main thread they raise
ValueError, and even on the main thread an expired timeout is swallowed into "no answer" or
"not equal", which would blame the model for the verifier's slowness. A thread stuck in SymPy
(``9^{9^{9^9}}``) cannot be stopped either. So math-verify runs with its own timeouts off, in worker
processes that this module kills when its deadline passes; that works from any verifier thread.
A worker is reused across samples, so SymPy is imported once per worker, not once per sample.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from tasks.verifiers.outcome import Outcome, Verdict, VerifierInfraError

VERSION = "2"  # bump when the parsing or comparison rules change; recorded with every reward

_TIMED_OUT_MEMORY = 100_000  # samples remembered as having timed out once (oldest forgotten first)

# The worker's reply statuses.
EQUAL, NOT_EQUAL, NO_ANSWER, BAD_REFERENCE = "equal", "not_equal", "no_answer", "bad_reference"


# -- pure logic: run inside the worker -----------------------------------------------------------


def score_answer(completion_text: str, reference: str) -> dict[str, str]:
    """Compare a completion's final answer with the reference; returns {"status", "detail"}.

    Runs math-verify without its signal-based timeouts, so call it where a hang can be killed
    (the worker process), or on trusted inputs.
    """
    from math_verify import parse, verify  # imports SymPy: seconds, so only where it is needed

    def is_maths(parsed: list[Any]) -> bool:
        # math-verify appends the raw matched string as a fallback; a reference must be maths.
        return any(not isinstance(item, str) for item in parsed)

    gold = parse(reference, parsing_timeout=None)
    if not is_maths(gold) and "\\" in reference:  # bare LaTeX ("\\sqrt{2}") needs delimiters;
        # plain words must not get them: between "$" they read as products of symbols.
        gold = parse(f"${reference}$", parsing_timeout=None)
    if not is_maths(gold):
        return {"status": BAD_REFERENCE, "detail": f"reference {reference[:200]!r} does not parse"}
    answer = parse(completion_text, parsing_timeout=None)
    if not answer:
        return {"status": NO_ANSWER, "detail": "no parseable final answer in the completion"}
    # Gold first: math-verify's comparison is asymmetric (e.g. "x=7" is accepted for gold "7").
    if verify(gold, answer, timeout_seconds=None):
        return {"status": EQUAL, "detail": ""}
    return {"status": NOT_EQUAL, "detail": f"answer {str(answer[0])[:200]!r} != reference {reference[:200]!r}"}


def verdict_from_reply(reply: dict[str, str]) -> Verdict:
    status, detail = reply.get("status"), reply.get("detail", "")
    if status == EQUAL:
        return Verdict(1.0, Outcome.SUCCESS)
    if status in (NOT_EQUAL, NO_ANSWER):
        return Verdict(0.0, Outcome.MODEL_FAILURE, detail)
    if status == BAD_REFERENCE:
        raise VerifierInfraError(detail, retryable=False)  # the dataset's fault: another attempt reads the same
    raise VerifierInfraError(f"math worker failed: {detail or reply!r}")


def _serve() -> None:
    """Worker main loop: one JSON request per stdin line, one JSON reply per stdout line.

    It ends when stdin closes, which happens when its verifier process exits, however it exits."""
    # The parent enforces the deadline, so math-verify's "timeout is disabled" warning is noise.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    protocol, sys.stdout = sys.stdout, sys.stderr  # a stray print must not corrupt the replies
    score_answer("1", "1")  # import and warm SymPy before saying ready
    protocol.write("ready\n")
    protocol.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = score_answer(request["completion"], request["reference"])
        except Exception as exc:  # noqa: BLE001 -- a verifier bug is reported, the worker lives on
            reply = {"status": "error", "detail": f"{type(exc).__name__}: {exc}"}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()


# -- the worker process, seen from the verifier ---------------------------------------------------


class _WorkerGone(Exception):
    pass


class _DeadlinePassed(_WorkerGone):
    pass


class _Worker:
    """One math-verify process, used by one verifier thread at a time."""

    def __init__(self, startup_timeout_s: float) -> None:
        root = str(Path(__file__).resolve().parents[2])  # the checkout holding tasks/
        boot = f"import sys; sys.path.insert(0, {root!r}); from tasks.verifiers.math import _serve; _serve()"
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", boot], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=root
            )
        except OSError as exc:
            raise VerifierInfraError(f"math worker could not start: {exc}") from exc
        self._pending = b""
        try:
            ready = self._read_line(time.monotonic() + startup_timeout_s)
        except _WorkerGone as exc:
            self.kill()
            raise VerifierInfraError(f"math worker did not start: {exc}") from None
        if ready != b"ready":
            self.kill()
            raise VerifierInfraError(f"math worker did not start: said {ready[:200]!r}")

    def alive(self) -> bool:
        return self._proc.poll() is None

    def ask(self, request: dict[str, str], timeout_s: float) -> dict[str, Any]:
        """One request, one reply; raises _WorkerGone on death or on the deadline."""
        deadline = time.monotonic() + timeout_s
        assert self._proc.stdin is not None
        try:
            # The worker is idle on its stdin, so a request larger than the pipe cannot deadlock.
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
        except OSError as exc:
            raise _WorkerGone(f"worker exited ({exc})") from None
        return json.loads(self._read_line(deadline))

    def _read_line(self, deadline: float) -> bytes:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _DeadlinePassed("deadline passed")
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise _WorkerGone(f"worker exited with {self._proc.wait()}")
                self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line

    def kill(self) -> None:
        self._proc.kill()  # SIGKILL: a worker stuck in SymPy ignores anything gentler
        self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                pipe.close()


class MathVerifier:
    """A ``Verifier`` (callable) backed by a pool of math-verify worker processes.

    Each concurrent caller gets its own worker, so the pool grows to the verifier pool's size.
    """

    def __init__(self, timeout_s: float = 5.0, startup_timeout_s: float = 60.0) -> None:
        if not 0 < timeout_s <= 600:
            raise ValueError(f"timeout_s={timeout_s} must be in (0, 600]; set a few seconds, e.g. 5")
        if not 0 < startup_timeout_s <= 600:
            raise ValueError(f"startup_timeout_s={startup_timeout_s} must be in (0, 600]; e.g. 60")
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._timed_out: OrderedDict[str, None] = OrderedDict()  # samples whose deadline expired once

    def __call__(self, completion_text: str, reference: str) -> Verdict:
        worker = self._checkout()
        try:
            reply = worker.ask({"completion": completion_text, "reference": reference}, self.timeout_s)
        except _DeadlinePassed:
            worker.kill()
            if self._timed_out_before(completion_text, reference):
                return Verdict(
                    0.0,
                    Outcome.MODEL_FAILURE,
                    f"the answer kept math-verify busy past its {self.timeout_s}s deadline on two attempts",
                )
            raise VerifierInfraError(
                f"math verifier gave no answer within {self.timeout_s}s (first time for this sample: retried "
                "before it is blamed on the answer)"
            ) from None
        except _WorkerGone as exc:
            worker.kill()
            raise VerifierInfraError(f"math verifier gave no answer: {exc}") from None
        except BaseException:
            worker.kill()
            raise
        with self._lock:
            self._idle.append(worker)
        return verdict_from_reply(reply)

    def _timed_out_before(self, completion_text: str, reference: str) -> bool:
        """Whether this sample's deadline expired before; records that it has now."""
        key = hashlib.sha256(json.dumps([completion_text, reference]).encode()).hexdigest()
        with self._lock:
            if key in self._timed_out:
                return True
            self._timed_out[key] = None
            if len(self._timed_out) > _TIMED_OUT_MEMORY:
                self._timed_out.popitem(last=False)
            return False

    def _checkout(self) -> _Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
                worker.kill()  # died while idle (killed from outside): reap it, try the next
        return _Worker(self.startup_timeout_s)  # outside the lock: starting takes a while

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


_shared: dict[float, MathVerifier] = {}
_shared_lock = threading.Lock()


def shared_verifier(timeout_s: float = 5.0) -> MathVerifier:
    """The registered ``math`` verifier: one MathVerifier per deadline, shared by every round of this
    process (its workers stay warm), closed at exit."""
    with _shared_lock:
        if timeout_s not in _shared:
            _shared[timeout_s] = MathVerifier(timeout_s)
            atexit.register(_shared[timeout_s].close)
        return _shared[timeout_s]
