"""Sandboxed Python verifier: run a completion's code, then the task's tests, in a contained sandbox.

The reference is the tests (Python with asserts). Tests that finish -> success 1.0. Anything the
model's code does wrong -> model_failure 0.0: an exception, a failed assert, exiting before the tests
finish, a timeout, or a resource limit. The sandbox failing to start -> VerifierInfraError, so it
never becomes a zero reward.

The contract between solution and tests (what makes a pass mean "solved", not "fooled the tests"):
- the solution runs in a process of its own; the tests run in another, which the solution's code
  cannot reach (not dumpable: no ptrace, no /proc access to its memory or file descriptors), and only
  that process holds the pass signal;
- the tests see the names the solution defines at top level: each function (anything callable) as a
  remote call, each plain-valued global as its value. Arguments and results cross as Python
  literals: None, bool, int, float, complex, str, bytes, and tuples, lists, sets and dicts of them,
  of those types exactly. A result of any other type (a subclass, an object whose ``__eq__`` always
  answers True) fails the call, so the tests only ever compare plain values they parsed themselves;
- an exception the solution raises reaches the tests under its builtin type (ValueError, ...), any
  other as RuntimeError; a mutated argument is not seen by the tests (it is a copy).
Tests written for that contract: call the solution's functions with literals, compare the results.

Containment (Linux; the verifier must run as root, as sessions and CI do):
- a private uid per run (random, high, unused), so RLIMIT_NPROC counts this sample's processes
  only and nothing else on the host is signal-able or writable by it; supplementary groups dropped,
  no_new_privs set so setuid binaries cannot climb back;
- fresh mount, network, pid, IPC and UTS namespaces: the whole filesystem is read-only except a
  size-limited tmpfs working directory; no network interface is up; the program is pid 1 of its
  own pid namespace, so when it exits the kernel kills and reaps everything it started (daemons
  included) and it cannot see or signal host processes;
- a seccomp filter that refuses every socket family except AF_UNIX: vsock, for one, is not
  network-namespaced and reaches the VM host in Firecracker-style machines;
- rlimits for CPU time, address space, processes, open files and core dumps; a wall-clock timeout
  and an output cap enforced here; an empty environment; ``python -I -S`` (stdlib only).

Setup runs in ``bootstrap`` (root, a fresh interpreter), which forks the sandboxed init; that
execs ``runner``, which loads the task, starts ``solution_server`` (a fresh interpreter running the
model's code) and runs the tests; the three live in sandbox_child.py and are sent as source. Their
progress comes back on pipes the model cannot forge: "R" on a close-on-exec status pipe means setup
finished; "S" on the result pipe means the interpreter started (before any model code); a per-run
nonce, known to the tests' process only, after the tests.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache

from tasks.config.verify import SandboxLimits
from tasks.verifiers.outcome import Outcome, Verdict, VerifierInfraError
from tasks.verifiers.sandbox_child import bootstrap, runner, solution_server

VERSION = "2"  # bump when isolation or classification changes; recorded with every reward
SANDBOX_UIDS = range(1_500_000_000, 1_600_000_000)  # per-run uids and gids; nothing else uses them


# -- pure logic --------------------------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion_text: str) -> str:
    """The last fenced code block (models show drafts first), else the whole completion."""
    blocks = _FENCE.findall(completion_text)
    return blocks[-1] if blocks else completion_text


@dataclass(frozen=True)
class SandboxRun:
    """What one run did, as seen from outside; ``classify`` turns it into a Verdict."""

    setup_error: str | None  # the bootstrap's own report; None once it handed over to the runner
    runner_started: bool  # the sandboxed interpreter loaded the task (before any model code ran)
    tests_passed: bool  # the runner wrote this run's nonce after the tests
    returncode: int | None  # of the bootstrap, which mirrors the program: 128+N means signal N
    timed_out: bool
    output_overflow: bool
    stdout_tail: str
    stderr_tail: str


def classify(run: SandboxRun, limits: SandboxLimits) -> Verdict:
    if run.setup_error is not None:
        raise VerifierInfraError(f"sandbox setup failed: {run.setup_error}")
    if not run.runner_started:  # the model's code never ran, so nothing here is the model's doing
        raise VerifierInfraError(
            f"sandbox interpreter did not start (exit {run.returncode}): "
            f"{_last_line(run.stderr_tail) or 'no error output'}"
        )
    if run.timed_out:
        return Verdict(0.0, Outcome.MODEL_FAILURE, f"timed out after {limits.wall_timeout_s}s")
    if run.output_overflow:
        return Verdict(0.0, Outcome.MODEL_FAILURE, f"output exceeded {limits.max_output_bytes} bytes")
    if run.tests_passed and run.returncode == 0:
        return Verdict(1.0, Outcome.SUCCESS)
    if run.tests_passed:
        return Verdict(0.0, Outcome.MODEL_FAILURE, f"tests passed but the program then {_exit_text(run.returncode)}")
    if run.returncode == 0:  # sys.exit(0) before the asserts: a classic reward hack, not a pass
        return Verdict(0.0, Outcome.MODEL_FAILURE, "the program exited before the tests finished")
    why = _last_line(run.stderr_tail) or "no error output"
    return Verdict(0.0, Outcome.MODEL_FAILURE, f"tests did not pass; the program {_exit_text(run.returncode)}: {why}")


def _exit_text(returncode: int | None) -> str:
    if returncode is not None and returncode > 128:
        try:
            name = signal.Signals(returncode - 128).name
        except ValueError:
            name = f"signal {returncode - 128}"
        return f"was killed by {name} (a limit, or its own doing)"
    return f"exited with {returncode}"


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


# -- the verifier ------------------------------------------------------------------------------


def verify_python(completion_text: str, reference: str, limits: SandboxLimits | None = None) -> Verdict:
    """The registered ``python`` verifier: the completion's code, then the reference's tests."""
    limits = limits or SandboxLimits()
    if not reference.strip():
        raise VerifierInfraError("the reference holds no tests", retryable=False)
    try:  # a broken test file is the dataset's fault; the model's own syntax errors fail in the sandbox
        compile(reference, "tests.py", "exec")
    except SyntaxError as exc:
        raise VerifierInfraError(f"the reference's tests do not compile: {exc}", retryable=False) from None
    return classify(run_sandboxed(extract_code(completion_text), reference, limits), limits)


def run_sandboxed(solution: str, tests: str, limits: SandboxLimits) -> SandboxRun:
    """Run solution then tests in a fresh sandbox; returns what happened, raises on setup trouble."""
    if sys.platform != "linux" or os.geteuid() != 0:
        raise VerifierInfraError(
            "the Python sandbox needs Linux and root (for namespaces and a private uid)", retryable=False
        )
    python = os.path.realpath(limits.python or getattr(sys, "_base_executable", sys.executable))
    uid = SANDBOX_UIDS.start + secrets.randbelow(len(SANDBOX_UIDS))
    nonce = secrets.token_hex(16)
    workdir = tempfile.mkdtemp(prefix="rlrounds-sandbox-")
    try:
        with open(os.path.join(workdir, "task.json"), "w") as task:  # root-only until the bootstrap moves it
            json.dump(
                {"solution": solution, "tests": tests, "nonce": nonce, "server": function_source(solution_server)}, task
            )
        status_r, status_w = os.pipe()
        result_r, result_w = os.pipe()
        command = bootstrap_command(
            workdir=workdir,
            uid=uid,
            python=python,
            runner=runner,
            status_fd=status_w,
            result_fd=result_w,
            limits=limits,
        )
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w, result_w),
                env={},
                start_new_session=True,
            )
        except OSError as exc:
            for fd in (status_r, result_r):
                os.close(fd)
            raise VerifierInfraError(f"sandbox could not start: {exc}") from exc
        finally:
            os.close(status_w)  # the only writers left are in the sandbox: EOF means they are gone
            os.close(result_w)
        try:
            outputs, timed_out, overflow = _collect(proc, status_r, result_r, limits)
        finally:
            stop_sandbox(proc, uid)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    status, result = outputs[status_r], outputs[result_r]
    setup_error = None
    if status != b"R":  # "R" alone: setup finished and the exec happened (the pipe closed on it)
        reported = status.removeprefix(b"R").removeprefix(b"E").decode(errors="replace")
        setup_error = reported or (
            f"bootstrap exited with {proc.returncode} before setup finished: "
            f"{_last_line(outputs[_STDERR].decode(errors='replace'))}"
        )
    return SandboxRun(
        setup_error=setup_error,
        runner_started=result.startswith(b"S"),
        tests_passed=result.startswith(b"S") and nonce.encode() in result,
        returncode=proc.returncode,
        timed_out=timed_out,
        output_overflow=overflow,
        stdout_tail=outputs[_STDOUT][-4096:].decode(errors="replace"),
        stderr_tail=outputs[_STDERR][-4096:].decode(errors="replace"),
    )


_STDOUT, _STDERR = -1, -2  # keys of the output map next to the real status/result fds


def _collect(
    proc: subprocess.Popen[bytes], status_r: int, result_r: int, limits: SandboxLimits
) -> tuple[dict[int, bytes], bool, bool]:
    """Read every pipe until all writers are gone, the wall clock runs out, or output overflows."""
    assert proc.stdout is not None and proc.stderr is not None
    keys = {proc.stdout.fileno(): _STDOUT, proc.stderr.fileno(): _STDERR, status_r: status_r, result_r: result_r}
    chunks: dict[int, list[bytes]] = {key: [] for key in keys.values()}
    output_bytes, timed_out, overflow = 0, False, False
    deadline = time.monotonic() + limits.wall_timeout_s
    # The fdopen contexts only close the two pipes when done.
    with selectors.DefaultSelector() as selector, os.fdopen(status_r, "rb"), os.fdopen(result_r, "rb"):
        for fd in keys:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and not overflow:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for ready, _ in selector.select(remaining):
                chunk = os.read(ready.fd, 1 << 16)
                if not chunk:
                    selector.unregister(ready.fd)
                    continue
                chunks[keys[ready.fd]].append(chunk)
                output_bytes += len(chunk)  # the result pipe counts too: the model can write to it
                overflow = output_bytes > limits.max_output_bytes
    return {key: b"".join(parts) for key, parts in chunks.items()}, timed_out, overflow


def bootstrap_command(
    *, workdir: str, uid: int, python: str, runner: object, status_fd: int, result_fd: int, limits: SandboxLimits
) -> list[str]:
    """The command that starts a sandbox: the bootstrap (tasks/verifiers/sandbox_child.py) with its settings, which
    runs ``runner`` (a self-contained function of sandbox_child.py or another such module) as the sandbox's init
    under ``uid``, in ``workdir``, within ``limits``; it reports setup on ``status_fd``, results on ``result_fd``."""
    config = {
        "workdir": workdir,
        "uid": uid,
        "python": python,
        "runner": function_source(runner),
        "status_fd": status_fd,
        "result_fd": result_fd,
        "cpu_s": limits.cpu_time_s,
        "memory_bytes": limits.memory_mib << 20,
        "nproc": limits.max_processes,
        "nofile": limits.max_open_files,
        "disk_mib": limits.disk_mib,
    }
    return [sys.executable, "-I", "-S", "-c", function_source(bootstrap), json.dumps(config)]


def stop_sandbox(proc: subprocess.Popen[bytes], uid: int) -> None:
    """End the run and prove it ended: no process of its uid may be left on the host."""
    if proc.poll() is None:
        proc.terminate()  # the bootstrap answers SIGTERM by killing the sandbox's init: all of it dies
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()  # the init has parent-death SIGKILL set, so it follows its bootstrap
            proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    for _ in range(20):
        survivors = processes_of(uid)
        if not survivors:
            return
        for pid in survivors:  # as root from outside every namespace: SIGKILL always lands
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    raise VerifierInfraError(f"sandbox processes {processes_of(uid)} of uid {uid} could not be killed")


def processes_of(uid: int) -> list[int]:
    """Host pids whose effective uid is ``uid`` (a /proc/<pid> directory is owned by it)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except FileNotFoundError:
                pass
    return pids


@cache
def function_source(function: object) -> str:
    """A self-contained function's source plus a call, for ``python -c`` in a fresh interpreter."""
    return inspect.getsource(function) + f"\n{function.__name__}()\n"  # type: ignore[attr-defined]
