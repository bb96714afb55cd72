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

Setup runs in ``_bootstrap`` (root, a fresh interpreter), which forks the sandboxed init; that
execs ``_runner``, which loads the task, starts ``_solution_server`` (a fresh interpreter running the
model's code) and runs the tests. Their progress comes back on pipes the model cannot forge: "R" on a
close-on-exec status pipe means setup finished; "S" on the result pipe means the interpreter started
(before any model code); a per-run nonce, known to the tests' process only, after the tests.
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

from pydantic import ConfigDict, ValidationInfo, field_validator

from tasks.config_base import Config
from tasks.verifiers.outcome import Outcome, Verdict, VerifierInfraError

VERSION = "2"  # bump when isolation or classification changes; recorded with every reward
SANDBOX_UIDS = range(1_500_000_000, 1_600_000_000)  # per-run uids and gids; nothing else uses them


class SandboxLimits(Config):
    """Resource limits for one sandboxed run. Worst-case memory of one sample is
    ``max_processes * memory_mib`` plus ``disk_mib``: size the verifier pool with that in mind."""

    model_config = ConfigDict(frozen=True)

    wall_timeout_s: float = 5.0
    """Seconds from launch until the whole sandbox is killed; the model's failure (it hung or slept)."""
    cpu_time_s: int = 5
    """RLIMIT_CPU of each process, whole seconds; a busy loop is killed (SIGKILL) when it runs out."""
    memory_mib: int = 256
    """RLIMIT_AS of each process, MiB of address space; allocations beyond it raise MemoryError."""
    max_processes: int = 8
    """RLIMIT_NPROC of the run's private uid: processes plus threads, so a fork bomb stops here."""
    max_open_files: int = 64
    """RLIMIT_NOFILE of each process."""
    max_output_bytes: int = 1 << 20
    """Bytes the program may write (stdout, stderr) before it is killed; only tails are kept."""
    disk_mib: int = 16
    """Size of the private tmpfs working directory, the only writable place."""
    python: str | None = None
    """Interpreter run inside the sandbox; None means this process's own base interpreter."""

    @field_validator(
        "wall_timeout_s",
        "cpu_time_s",
        "memory_mib",
        "max_processes",
        "max_open_files",
        "max_output_bytes",
        "disk_mib",
    )
    @classmethod
    def _in_range(cls, value: float, info: ValidationInfo) -> float:
        low, high, why = _RANGES[info.field_name or ""]
        if not low <= value <= high:
            raise ValueError(f"{info.field_name}={value} is out of range: {why}; set it between {low} and {high}")
        return value


_RANGES: dict[str, tuple[float, float, str]] = {
    "wall_timeout_s": (0.5, 600, "below 0.5 s the interpreter may not even start"),
    "cpu_time_s": (1, 600, "RLIMIT_CPU counts whole seconds"),
    "memory_mib": (64, 65536, "the Python interpreter alone maps about 30 MiB"),
    "max_processes": (1, 4096, "the program itself is one process"),
    "max_open_files": (16, 65536, "the interpreter opens a few files to start"),
    "max_output_bytes": (1024, 1 << 30, "error messages need a few KiB of output"),
    "disk_mib": (1, 65536, "the task file is written there first"),
}


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
            json.dump({"solution": solution, "tests": tests, "nonce": nonce, "server": _source(_solution_server)}, task)
        status_r, status_w = os.pipe()
        result_r, result_w = os.pipe()
        config = {
            "workdir": workdir,
            "uid": uid,
            "python": python,
            "runner": _source(_runner),
            "status_fd": status_w,
            "result_fd": result_w,
            "cpu_s": limits.cpu_time_s,
            "memory_bytes": limits.memory_mib << 20,
            "nproc": limits.max_processes,
            "nofile": limits.max_open_files,
            "disk_mib": limits.disk_mib,
        }
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _source(_bootstrap), json.dumps(config)],
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
            _stop(proc, uid)
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


def _stop(proc: subprocess.Popen[bytes], uid: int) -> None:
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
def _source(function: object) -> str:
    """A self-contained function's source plus a call, for ``python -c`` in a fresh interpreter."""
    return inspect.getsource(function) + f"\n{function.__name__}()\n"  # type: ignore[attr-defined]


# -- code that runs inside the sandbox (stdlib only, no globals: each is sent as source) ---------


def _bootstrap() -> None:
    """As root: namespaces, read-only mounts, then fork the sandbox's init, drop it and exec."""
    import ctypes
    import json
    import os
    import resource
    import signal
    import struct
    import sys

    cfg = json.loads(sys.argv[1])
    status, workdir, uid = cfg["status_fd"], cfg["workdir"], cfg["uid"]
    os.set_inheritable(status, False)  # closed by the exec: the model can never write to it
    libc = ctypes.CDLL(None, use_errno=True)

    def check(ret: int, what: str) -> None:
        if ret != 0:
            raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")

    def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        args = [None if s is None else s.encode() for s in (source, target, fstype, data)]
        check(libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]), f"mount {target}")

    def fail(exc: BaseException) -> None:
        os.write(status, f"E{type(exc).__name__}: {exc}".encode())
        os._exit(1)

    PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 38, 22
    MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a dead verifier takes its sandbox along
        # NEWNS | NEWUTS | NEWIPC | NEWPID | NEWNET
        check(libc.unshare(0x00020000 | 0x04000000 | 0x08000000 | 0x20000000 | 0x40000000), "unshare")
        mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates to the host
        with open(os.path.join(workdir, "task.json"), "rb") as f:
            task = f.read()
        # The interpreter may live under a directory others cannot enter (pyenv in /root): show
        # the sandbox that installation alone, bound over a tmpfs that hides the rest.
        prefix = os.path.dirname(os.path.dirname(cfg["python"]))
        parts, blocked = prefix.strip("/").split("/"), None
        for i in range(1, len(parts) + 1):
            if not os.stat("/" + "/".join(parts[:i])).st_mode & 0o001:
                blocked = "/" + "/".join(parts[:i])
                break
        if blocked is not None:
            keep = os.open(prefix, os.O_PATH)
            mount("tmpfs", blocked, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
            os.makedirs(prefix, 0o755, exist_ok=True)
            mount(f"/proc/self/fd/{keep}", prefix, None, MS_BIND | MS_REC)
        # mount_setattr(AT_FDCWD, "/", AT_RECURSIVE, {RDONLY | NOSUID}): everything read-only.
        attr = struct.pack("QQQQ", 0x1 | 0x2, 0, 0, 0)
        check(libc.syscall(442, -100, b"/", 0x8000, attr, len(attr)), "mount_setattr read-only")
        mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_mib']}m,mode=0700,uid={uid},gid={uid}")
        task_path = os.path.join(workdir, "task.json")  # now on the tmpfs; the host copy is hidden
        with open(task_path, "wb") as f:
            f.write(task)
        os.chown(task_path, uid, uid)
        child = os.fork()
    except BaseException as exc:  # noqa: BLE001 -- reported to the verifier as an infra failure
        fail(exc)
    if child == 0:  # pid 1 of the new pid namespace
        try:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            os.setsid()
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # shows this namespace only
            os.chdir(workdir)
            for limit, value in (
                (resource.RLIMIT_CPU, cfg["cpu_s"]),
                (resource.RLIMIT_AS, cfg["memory_bytes"]),
                (resource.RLIMIT_NPROC, cfg["nproc"]),
                (resource.RLIMIT_NOFILE, cfg["nofile"]),
                (resource.RLIMIT_CORE, 0),
            ):
                resource.setrlimit(limit, (value, value))  # soft == hard: the CPU limit ends in SIGKILL
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the uid change cleared it
            check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
            arch, socket_nr = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}[os.uname().machine]
            program = [  # classic BPF over seccomp_data: (code, jump-if-true, jump-if-false, k)
                (0x20, 0, 0, 4),  # load arch
                (0x15, 0, 8, arch),  # foreign arch: kill
                (0x20, 0, 0, 0),  # load syscall number
                (0x35, 6, 0, 0x40000000),  # x32 ABI: kill
                (0x15, 3, 0, 425),  # io_uring_setup (could open sockets behind the filter): refuse
                (0x15, 0, 3, socket_nr),  # not socket(): allow
                (0x20, 0, 0, 16),  # load the address family (args[0])
                (0x15, 1, 0, 1),  # AF_UNIX: allow
                (0x06, 0, 0, 0x00050000 | 13),  # refuse with EACCES
                (0x06, 0, 0, 0x7FFF0000),  # allow
                (0x06, 0, 0, 0x80000000),  # kill the process
            ]
            code = b"".join(struct.pack("HBBI", *insn) for insn in program)
            buffer = ctypes.create_string_buffer(code)
            fprog = struct.pack("HxxxxxxQ", len(program), ctypes.addressof(buffer))
            check(libc.prctl(PR_SET_SECCOMP, 2, ctypes.c_char_p(fprog), 0, 0), "seccomp")
            os.write(status, b"R")
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
            os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-c", cfg["runner"], str(cfg["result_fd"])], env)
        except BaseException as exc:  # noqa: BLE001
            fail(exc)
    os.close(status)
    os.close(cfg["result_fd"])
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))  # the verifier's stop
    _, wait_status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(wait_status)
    os._exit(code if code >= 0 else 128 - code)


def _runner() -> None:
    """The sandboxed interpreter's first code, pid 1: load the task, start the solution in a process of
    its own, then run the tests here, calling the solution's functions over a pipe.

    The model's code never runs in this process: it cannot reach the tests, their namespace, the
    nonce or the result pipe, and what comes back from it is parsed as a Python literal, so only
    plain values (no object with its own ``__eq__``) are ever compared by the tests."""
    import ast
    import builtins
    import ctypes
    import json
    import os
    import signal
    import sys

    result = int(sys.argv[1])
    with open("task.json", "rb") as f:  # read before any model code can rewrite the tests
        task = json.loads(f.read())
    os.unlink("task.json")
    os.write(result, b"S")  # the model's code runs after this: nothing it does can unsay it
    # Not dumpable: a process of the same uid can neither ptrace this one nor open its /proc entries
    # (its memory, its file descriptors), so the solution's process cannot reach the result pipe.
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    calls_r, calls_w = os.pipe()
    replies_r, replies_w = os.pipe()
    child = os.fork()
    if child == 0:  # a fresh interpreter, so not even this process's memory (the nonce) is inherited
        os.close(result)
        os.close(calls_w)
        os.close(replies_r)
        os.set_inheritable(calls_r, True)
        os.set_inheritable(replies_w, True)
        os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", task["server"], str(calls_r), str(replies_w)])
    os.close(calls_r)
    os.close(replies_w)
    calls = os.fdopen(calls_w, "w")
    replies = os.fdopen(replies_r, "r")

    class SolutionGone(Exception):
        pass

    def gone() -> SolutionGone:
        _, status = os.waitpid(child, 0)
        code = os.waitstatus_to_exitcode(status)
        if code >= 0:
            how = f"exited with {code}"
        else:
            how = f"was killed by {signal.Signals(-code).name} (a limit, or its own doing)"
        return SolutionGone(f"the solution's process {how} before the tests finished")

    def ask(message: object) -> object:
        try:
            calls.write(repr(message) + "\n")
            calls.flush()
        except OSError:
            raise gone() from None
        line = replies.readline()
        if not line:
            raise gone()
        status, _, payload = line.partition(" ")
        try:
            value = ast.literal_eval(payload)  # a literal or nothing: never an object the solution made
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            raise TypeError("the solution answered with something that is not a plain value") from None
        if status == "ok":
            return value
        kind, text = value if isinstance(value, tuple) and len(value) == 2 else ("Exception", repr(value))
        if kind == "SystemExit":
            raise SolutionGone(f"the solution exited before the tests finished (SystemExit {text})")
        error = getattr(builtins, str(kind), None)
        if isinstance(error, type) and issubclass(error, Exception) and not issubclass(error, SolutionGone):
            raise error(text)  # tests may expect e.g. ValueError from the solution
        raise RuntimeError(f"{kind}: {text}")

    def remote(name: str):
        def call(*args, **kwargs):
            return ask(("call", name, args, kwargs))

        call.__name__ = name
        return call

    ask(("load", task.pop("solution")))
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    for name, (kind, value) in ask(("names",)).items():
        namespace[name] = remote(name) if kind == "call" else value
    exec(compile(task.pop("tests"), "tests.py", "exec"), namespace)
    os.write(result, task["nonce"].encode())


def _solution_server() -> None:
    """The solution's process: run the model's code, then answer the tests' calls of its functions.

    Requests and replies are one Python literal per line. A result is sent only if it is a plain
    value of builtin types exactly (no subclass, nothing with its own ``__eq__``); an exception is sent
    as its type's name and message. Whatever this process does, the tests parse only literals."""
    import ast
    import os
    import sys

    calls = os.fdopen(int(sys.argv[1]), "r")
    replies = os.fdopen(int(sys.argv[2]), "w")
    scalars = (type(None), bool, int, float, complex, str, bytes)

    def plain(value, depth=0):
        kind = type(value)
        if depth > 100:
            raise TypeError("the value is nested more than 100 deep")
        if kind in scalars:
            if kind in (float, complex) and value != value or repr(value) in ("inf", "-inf"):
                raise TypeError(f"{value!r} has no literal form")
            return value
        if kind in (list, tuple, set, frozenset):
            for item in value:
                plain(item, depth + 1)
            return value
        if kind is dict:
            for key, item in value.items():
                plain(key, depth + 1)
                plain(item, depth + 1)
            return value
        raise TypeError(
            f"a {kind.__name__} is not a plain value (None, bool, int, float, complex, str, bytes, "
            "or tuples, lists, sets and dicts of them)"
        )

    def reply(status, payload):
        replies.write(f"{status} {payload!r}\n")
        replies.flush()

    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    for line in calls:
        request = ast.literal_eval(line)
        try:
            if request[0] == "load":
                exec(compile(request[1], "solution.py", "exec"), namespace)
                reply("ok", None)
            elif request[0] == "names":
                names = {}
                for name, value in list(namespace.items()):
                    if name.startswith("__"):
                        continue
                    if callable(value):
                        names[name] = ("call", None)
                    else:
                        try:
                            names[name] = ("value", plain(value))
                        except (TypeError, RecursionError):
                            pass  # modules, objects: out of the tests' reach
                reply("ok", names)
            else:
                reply("ok", plain(namespace[request[1]](*request[2], **request[3])))
        except BaseException as exc:  # noqa: BLE001 -- SystemExit too: the tests decide what it means
            reply("err", (type(exc).__name__, str(exc)[:2000]))
