"""A warm pool of tool sandboxes, sized independently of the engine, so environments stay off its critical path.

Each sandbox is the verifier sandbox's containment (tasks/verifiers/sandbox.py: namespaces, a private uid,
read-only filesystem, no network, seccomp, rlimits) around a *template* interpreter that has loaded the tools
once (tasks/environments/tool_child.py). A call takes an idle sandbox, and the template forks a fresh process
for it: no interpreter to start, nothing to import, and nothing left over from another episode's call. With
``warm=False`` every call starts a cold sandbox instead and stops it after (the baseline of
benchmarks/episodes.py).

What a call can end in (``ToolReply``):

    the tool returned           text = its str, the episode goes on
    the tool raised             text = "Error: <type>: <message>", error=True: the model reads it (its
                                arguments may be wrong); the step is not a failure
    the call's process died     infra = why: an infrastructure failure of the step (the sandbox template
                                lives on and takes the next call)
    no reply within timeout_s   infra = "hung": the whole sandbox is stopped and a replacement started in
                                the background; an infrastructure failure of the step
    the sandbox could not start infra = why

Stats: seconds callers waited for a free sandbox, cold starts, replacements.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tasks.config.environment import ToolPoolConfig
from tasks.config.verify import SandboxLimits
from tasks.environments.tool_child import tool_server
from tasks.environments.tools import Tool, tools_source
from tasks.verifiers.sandbox import SANDBOX_UIDS, bootstrap_command, stop_sandbox

MAX_REPLY_CHARS = 4096
"""The most characters of a tool's answer returned to the policy: a long answer costs prefill of every later turn."""
START_TIMEOUT_S = 20.0
"""Seconds a sandbox may take to start (namespaces, interpreter, the tools' imports) before it is an infra failure."""


class SandboxStartError(RuntimeError):
    pass


class SandboxHung(RuntimeError):
    pass


@dataclass(frozen=True)
class ToolReply:
    text: str
    """What the policy reads: the tool's answer, or its error."""
    error: bool = False
    """The tool raised (the model's arguments, usually): not a failure of the step."""
    infra: str | None = None
    """Why the step is an infrastructure failure (the call's process died, it hung, no sandbox), else None."""
    seconds: float = 0.0
    """Wall seconds of the call, from a free sandbox to its reply (a cold sandbox's start included)."""
    waited_s: float = 0.0
    """Seconds the call waited for a free sandbox."""


class ToolSandbox:
    """One started sandbox around a template that has loaded ``source``; answers calls one at a time."""

    def __init__(self, source: str, limits: SandboxLimits) -> None:
        if sys.platform != "linux" or os.geteuid() != 0:
            raise SandboxStartError("tool sandboxes need Linux and root (namespaces and a private uid)")
        self.uid = SANDBOX_UIDS.start + secrets.randbelow(len(SANDBOX_UIDS))
        self._next_id = 0
        self._buffer = b""
        python = os.path.realpath(limits.python or getattr(sys, "_base_executable", sys.executable))
        self.workdir = tempfile.mkdtemp(prefix="rlrounds-tools-")
        with open(os.path.join(self.workdir, "task.json"), "w") as task:
            json.dump({"source": source, "max_reply_chars": MAX_REPLY_CHARS}, task)
        status_r, status_w = os.pipe()
        self._result, result_w = os.pipe()
        command = bootstrap_command(
            workdir=self.workdir,
            uid=self.uid,
            python=python,
            runner=tool_server,
            status_fd=status_w,
            result_fd=result_w,
            limits=limits,
        )
        try:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(status_w, result_w),
                env={},
                start_new_session=True,
            )
        except OSError as exc:
            for fd in (status_r, self._result):
                os.close(fd)
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise SandboxStartError(f"sandbox could not start: {exc}") from exc
        finally:
            os.close(status_w)
            os.close(result_w)
        try:
            status = _read_all(status_r, START_TIMEOUT_S)
            if status != b"R":
                raise SandboxStartError(f"sandbox setup failed: {status.removeprefix(b'E').decode(errors='replace')}")
            ready = self._read(1, time.monotonic() + START_TIMEOUT_S)
            if ready != b"S":
                raise SandboxStartError("the tool template did not load its tools (a tool's source fails to run)")
        except BaseException:
            self.close()
            raise

    def call(self, name: str, arguments: dict, timeout_s: float) -> dict:
        """The template's reply to one call (tool_child.py's protocol). Raises ``SandboxHung`` past the timeout and
        ``SandboxStartError`` if the sandbox is gone; the caller must close this sandbox after either."""
        self._next_id += 1
        request = json.dumps({"id": self._next_id, "name": name, "arguments": arguments}) + "\n"
        try:
            self.proc.stdin.write(request.encode())
            self.proc.stdin.flush()
        except OSError:
            raise SandboxStartError("the tool sandbox is gone") from None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            self._buffer += self._read(1 << 16, deadline)
        line, _, self._buffer = self._buffer.partition(b"\n")
        reply = json.loads(line)
        if reply.get("id") != self._next_id:
            raise SandboxStartError(f"the tool sandbox answered call {reply.get('id')} for {self._next_id}")
        return reply

    def _read(self, size: int, deadline: float) -> bytes:
        with selectors.DefaultSelector() as selector:
            selector.register(self._result, selectors.EVENT_READ)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):
                raise SandboxHung("no reply in time")
        chunk = os.read(self._result, size)
        if not chunk:
            raise SandboxStartError("the tool sandbox exited")
        return chunk

    def close(self) -> None:
        """Stop the sandbox and everything in it (every process of its private uid)."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        stop_sandbox(self.proc, self.uid)
        try:
            os.close(self._result)
        except OSError:
            pass
        shutil.rmtree(self.workdir, ignore_errors=True)


def _read_all(fd: int, timeout_s: float) -> bytes:
    """Everything written to ``fd`` until its writers are gone (the status pipe closes on the template's exec)."""
    chunks, deadline = [], time.monotonic() + timeout_s
    with os.fdopen(fd, "rb", buffering=0) as pipe, selectors.DefaultSelector() as selector:
        selector.register(pipe, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not selector.select(remaining):
                raise SandboxStartError("the sandbox did not finish its setup in time")
            chunk = pipe.read(1 << 12)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


@dataclass
class ToolPoolStats:
    calls: int = 0
    wait_s: float = 0.0
    """Seconds callers spent waiting for a free sandbox, summed."""
    cold_starts: int = 0
    """Sandboxes started for one call (``warm=False``)."""
    replacements: int = 0
    """Warm sandboxes stopped (a hung call, a dead template) and started again."""
    infra_failures: int = 0


class ToolPool:
    """``config.sandboxes`` sandboxes with ``tools`` loaded, shared by every episode; thread-safe ``call``."""

    def __init__(self, tools: Sequence[Tool], config: ToolPoolConfig | None = None) -> None:
        self.config = config or ToolPoolConfig()
        self.source = tools_source(tools)
        self.stats = ToolPoolStats()
        self._lock = threading.Lock()
        self._idle: queue.Queue[ToolSandbox | None] = queue.Queue()
        self._slots = threading.Semaphore(self.config.sandboxes)  # cold mode: the most sandboxes at once
        self._closed = False
        # Sandboxes are started by one thread that lives as long as the pool: a sandbox dies with the thread that
        # started it (the bootstrap's parent-death signal follows the thread), so never from a passing thread.
        self._starts: queue.Queue[bool] = queue.Queue()
        self._starter = threading.Thread(target=self._start_loop, name="tool-sandbox-starter", daemon=True)
        self._starter.start()
        if self.config.warm:
            for _ in range(self.config.sandboxes):
                self._starts.put(True)
            while self._idle.qsize() < self.config.sandboxes:  # the pool is warm before the first episode
                time.sleep(0.005)

    def _start_loop(self) -> None:
        while self._starts.get():
            try:
                sandbox = ToolSandbox(self.source, self.config.limits)
            except SandboxStartError:
                sandbox = None  # callers see why when they take it
            if self._closed and sandbox is not None:
                sandbox.close()
                continue
            self._idle.put(sandbox)

    def call(self, name: str, arguments: dict, *, timeout_s: float) -> ToolReply:
        """Run one tool call within ``timeout_s`` seconds (a cold sandbox's start included); never raises for what
        the call did (the module doc's table)."""
        began = time.perf_counter()
        sandbox: ToolSandbox | None = None
        if self.config.warm:
            sandbox = self._idle.get()
        else:
            self._slots.acquire()
        waited = time.perf_counter() - began
        try:
            if not self.config.warm:
                with self._lock:
                    self.stats.cold_starts += 1
                sandbox = ToolSandbox(self.source, self.config.limits)
            elif sandbox is None:  # a replacement that could not start: ask for another, in the background
                self._starts.put(True)
                raise SandboxStartError("no tool sandbox could be started")
            reply = sandbox.call(name, arguments, max(timeout_s - (time.perf_counter() - began - waited), 0.0))
        except (SandboxHung, SandboxStartError) as exc:
            self._discard(sandbox)
            why = f"the tool call hung past {timeout_s:g}s" if isinstance(exc, SandboxHung) else str(exc)
            return self._done(ToolReply(text="", infra=why), began + waited, waited)
        if self.config.warm:
            self._idle.put(sandbox)  # the template is unchanged by the call (it ran in a fork): reuse it
        else:
            sandbox.close()
            self._slots.release()
        if "crash" in reply:
            return self._done(ToolReply(text="", infra=reply["crash"]), began + waited, waited)
        if "error" in reply:
            return self._done(ToolReply(text=f"Error: {reply['error']}", error=True), began + waited, waited)
        return self._done(ToolReply(text=reply["ok"]), began + waited, waited)

    def _discard(self, sandbox: ToolSandbox | None) -> None:
        """Stop a sandbox that hung or died; a warm pool starts its replacement in the background."""
        if sandbox is not None:
            sandbox.close()
        if self.config.warm:
            if sandbox is not None:
                with self._lock:
                    self.stats.replacements += 1
                self._starts.put(True)
        else:
            self._slots.release()

    def _done(self, reply: ToolReply, started: float, waited: float) -> ToolReply:
        seconds = time.perf_counter() - started
        with self._lock:
            self.stats.calls += 1
            self.stats.wait_s += waited
            self.stats.infra_failures += reply.infra is not None
        return ToolReply(reply.text, reply.error, reply.infra, seconds, waited)

    def close(self) -> None:
        """Stop every sandbox, then the starter thread (in that order: a sandbox must not outlive its starter)."""
        self._closed = True
        while True:
            try:
                sandbox = self._idle.get_nowait()
            except queue.Empty:
                break
            if sandbox is not None:
                sandbox.close()
        self._starts.put(False)
        self._starter.join(timeout=START_TIMEOUT_S)

    def __enter__(self) -> ToolPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
