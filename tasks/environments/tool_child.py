"""The tool sandbox's own side: ``tool_server``, sent as source to the sandboxed interpreter that
tasks/verifiers/sandbox_child.py's ``bootstrap`` starts (namespaces, private uid, seccomp, rlimits: the
containment tasks/verifiers/sandbox.py describes). Stdlib only and self-contained, like sandbox_child.py.

It is the pool's *template*: it loads the tools' source once (the imports they make are done then), says it is
ready, and then answers one call per request line. Each call runs in a process forked from the template, so a
call starts warm (nothing to import) and clean (nothing an earlier call did is left: the template itself never
runs a call). The forked process writes its reply to a private pipe and exits; the template forwards the reply.

Protocol (one JSON object per line): requests on stdin ``{"id", "name", "arguments"}``; replies on the
result pipe (argv[1]) ``{"id", "ok": str}`` (the tool returned: its ``str``), ``{"id", "error": str}``
(the tool raised: the model may read why), or ``{"id", "crash": str}`` (the call's process died without a
reply: an infrastructure failure). The first bytes on the result pipe are ``S`` once the tools are loaded.
"""


def tool_server() -> None:
    """pid 1 of the sandbox: load the tools, then fork one process per call and forward its reply."""
    import ctypes
    import json
    import os
    import signal
    import sys

    result = int(sys.argv[1])
    with open("task.json", "rb") as f:
        task = json.loads(f.read())
    os.unlink("task.json")
    tools: dict = {}
    exec(compile(task["source"], "tools.py", "exec"), tools)  # the template's one import of the tools
    # Not dumpable: a call's process (same uid) can neither ptrace the template nor open its /proc entries,
    # so it cannot reach the result pipe or the request stream.
    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
    os.write(result, b"S")
    requests = os.fdopen(0, "r")

    def reply(message: dict) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(result, data) :]

    for line in requests:
        try:
            request = json.loads(line)
            call_id, name, arguments = request["id"], request["name"], request["arguments"]
        except (ValueError, KeyError, TypeError):
            reply({"id": None, "crash": "malformed request"})
            continue
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:  # the call: it never returns to the loop
            try:
                os.setpgid(0, 0)  # its own group: whatever it starts is stopped with it
                os.close(read_end)
                os.close(result)
                os.close(0)
                function = tools.get(name)
                if not callable(function):
                    out = {"error": f"NameError: no tool named {name!r}"}
                else:
                    try:
                        out = {"ok": str(function(**arguments))[: task["max_reply_chars"]]}
                    except Exception as exc:  # noqa: BLE001 -- the tool's own error, reported to the model
                        out = {"error": f"{type(exc).__name__}: {exc}"[: task["max_reply_chars"]]}
                data = json.dumps(out).encode()
                while data:
                    data = data[os.write(write_end, data) :]
            finally:
                os._exit(0)
        os.close(write_end)
        chunks = []
        while True:
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(read_end)
        _, status = os.waitpid(child, 0)
        try:
            os.killpg(child, signal.SIGKILL)  # what the call started and left running
        except (ProcessLookupError, PermissionError):
            pass
        while True:  # pid 1 reaps what the call left behind (its children are reparented here)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        try:
            out = json.loads(b"".join(chunks))
            if not isinstance(out, dict) or not ({"ok", "error"} & set(out)):
                raise ValueError
        except ValueError:
            code = os.waitstatus_to_exitcode(status)
            how = f"exited with {code}" if code >= 0 else f"was killed by {signal.Signals(-code).name}"
            out = {"crash": f"the tool's process {how} without a reply"}
        out["id"] = call_id
        reply(out)
