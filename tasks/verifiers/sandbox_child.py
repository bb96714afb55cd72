"""The sandbox's own side: three stdlib-only functions that tasks/verifiers/sandbox.py sends as source
to fresh interpreters (``python -I -S -c``), so each is self-contained: no globals, no imports at module
level, nothing from rlrounds.

- ``bootstrap`` runs as root: namespaces, read-only mounts, then forks the sandbox's init, drops it to
  the run's private uid and execs ``runner``;
- ``runner`` is the tests' process: it loads the task, starts ``solution_server`` and runs the tests,
  and only it holds the pass signal (the run's nonce);
- ``solution_server`` is a fresh interpreter running the model's code, answering the tests' calls.

The contract between them and the containment they set up are described in sandbox.py.
"""


def bootstrap() -> None:
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


def runner() -> None:
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


def solution_server() -> None:
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
