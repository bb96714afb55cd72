"""Tools as plain functions, and the warm pool of sandboxes that runs them (tasks/environments/tools.py,
tool_pool.py): schemas, rendering through the chat template, parsing calls, and what a call can end in. Hostile
arguments stay inside the sandbox; a crash or a hang is an infrastructure failure, a raised error is the model's."""

import os
import threading

import pytest

from tasks.config.environment import EpisodeBudget, ToolPoolConfig
from tasks.environments.tool_pool import ToolPool
from tasks.environments.tools import Tool, ToolCall, ToolCallError, parse_tool_call, render_with_tools

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root (namespaces, a private uid)")


def add(a: int, b: int = 0) -> int:
    """Add two integers exactly.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def run_python(code: str) -> str:
    """Evaluate a Python expression (a tool that trusts its argument: the sandbox must contain it)."""
    return repr(eval(code))


def nap(seconds: float) -> str:
    """Sleep, then answer."""
    import time

    time.sleep(seconds)
    return "awake"


def crash() -> str:
    """Die without answering."""
    import os

    os._exit(3)


TOOLS = [Tool.from_function(f) for f in (add, run_python, nap, crash)]


def test_a_function_becomes_a_tool_schema():
    schema = TOOLS[0].schema()["function"]
    assert schema["name"] == "add" and schema["description"] == "Add two integers exactly."
    assert schema["parameters"] == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "the first addend"},
            "b": {"type": "integer", "description": "the second addend"},
        },
        "required": ["a"],  # b has a default
    }

    def untyped(x):
        """No annotation."""

    with pytest.raises(ValueError, match="no type annotation"):
        Tool.from_function(untyped)


@pytest.mark.parametrize(
    "text, expected",
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', ToolCall("add", {"a": 1, "b": 2})),
        ('sure <tool_call>{"name": "add", "arguments": {"a": 1}}', ToolCall("add", {"a": 1})),  # stopped at the tag
        ("The answer is 3.", None),  # no call: a final answer
        ("<tool_call>add(1, 2)</tool_call>", ToolCallError),  # not JSON
        ('<tool_call>{"arguments": {}}</tool_call>', ToolCallError),  # no name
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', ToolCallError),  # arguments not an object
    ],
)
def test_parse_tool_call(text, expected):
    if expected is ToolCallError:
        with pytest.raises(ToolCallError):
            parse_tool_call(text)
    else:
        assert parse_tool_call(text) == expected


def test_tools_render_through_the_template_when_it_takes_them_else_as_text():
    from models.builtin.chat_example import build_chat_tokenizer

    tok = build_chat_tokenizer(["What is 2 + 2?"])
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    plain = render_with_tools(tok, messages, TOOLS[:1])  # this template ignores tools=: listed in a system turn
    assert "<|im_start|>system\nYou can call these tools:\n- add(a: integer, b: integer)" in plain
    tok.chat_template = (
        "{% if tools %}<|im_start|>system\nTOOLS {{ tools | map(attribute='function.name') | join(',') }}"
        "<|im_end|>\n{% endif %}" + tok.chat_template
    )
    assert render_with_tools(tok, messages, TOOLS[:2]).startswith("<|im_start|>system\nTOOLS add,run_python<|im_end|>")


def test_budget_refuses_a_step_timeout_longer_than_the_whole_tool_budget():
    with pytest.raises(ValueError, match="step_timeout_s=20.0 exceeds max_tool_seconds=5.0"):
        EpisodeBudget(step_timeout_s=20, max_tool_seconds=5)


@needs_root
def test_what_a_call_can_end_in_and_hostile_arguments_stay_in_the_sandbox(tmp_path):
    host_file = tmp_path / "written-by-a-tool"
    with ToolPool(TOOLS, ToolPoolConfig(sandboxes=1)) as pool:
        assert pool.call("add", {"a": 10**40, "b": 1}, timeout_s=5).text == str(10**40 + 1)  # exact, any length
        # the tool raised on the model's arguments: shown to the model, not a failure of the step
        bad = pool.call("add", {"a": "x", "b": 1}, timeout_s=5)
        assert bad.error and bad.infra is None and bad.text.startswith("Error: TypeError")
        hostile = {
            # the host's files are read-only in there, and the host's temp directory is not even the same one
            f"open({str(host_file)!r}, 'w').write('x')": "Error: ",
            # no network: the seccomp filter refuses every socket family but AF_UNIX
            "__import__('socket').socket(__import__('socket').AF_INET)": "Error: PermissionError",
            # the template (pid 1 of the sandbox) cannot be signalled from its calls
            "__import__('os').kill(1, 9)": "None",
            # the host's processes are not visible: its own pid namespace holds the template and this call
            "sorted(int(p) for p in __import__('os').listdir('/proc') if p.isdigit())[:1] == [1]": "True",
            "len([p for p in __import__('os').listdir('/proc') if p.isdigit()]) <= 3": "True",
        }
        for code, answer in hostile.items():
            reply = pool.call("run_python", {"code": code}, timeout_s=5)
            assert reply.text.startswith(answer) and reply.infra is None, (code, reply)
        assert not host_file.exists()
        # a crash and a hang are infrastructure failures of the step; the pool keeps serving after either
        crashed = pool.call("crash", {}, timeout_s=5)
        assert crashed.infra == "the tool's process exited with 3 without a reply" and not crashed.error
        hung = pool.call("nap", {"seconds": 30}, timeout_s=0.5)
        assert hung.infra == "the tool call hung past 0.5s" and hung.seconds < 5
        assert pool.call("add", {"a": 1, "b": 2}, timeout_s=5).text == "3"  # the replacement sandbox answers
        assert pool.stats.replacements == 1 and pool.stats.infra_failures == 2


@needs_root
def test_calls_beyond_the_pool_wait_for_a_sandbox_and_the_wait_is_counted():
    with ToolPool(TOOLS, ToolPoolConfig(sandboxes=1)) as pool:
        replies = []
        threads = [
            threading.Thread(target=lambda: replies.append(pool.call("nap", {"seconds": 0.3}, timeout_s=5)))
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.text for r in replies] == ["awake", "awake"]
        assert max(r.waited_s for r in replies) > 0.2  # the second call waited for the first's sandbox
        assert pool.stats.wait_s > 0.2 and pool.stats.cold_starts == 0


@needs_root
def test_a_cold_pool_starts_a_sandbox_per_call():
    with ToolPool(TOOLS, ToolPoolConfig(sandboxes=2, warm=False)) as pool:
        assert [pool.call("add", {"a": i, "b": 1}, timeout_s=10).text for i in range(3)] == ["1", "2", "3"]
        assert pool.stats.cold_starts == 3


@needs_root
@pytest.mark.parametrize("warm", [True, False])
def test_tools_that_cannot_load_make_every_call_an_infra_failure(warm):
    """A template that cannot load its tools is the environment's failure, warm or cold: never the model's."""
    broken = Tool(
        "broken", "Fails to load.", {"type": "object", "properties": {}, "required": []}, "raise SystemExit(1)\n"
    )
    with ToolPool([broken], ToolPoolConfig(sandboxes=1, warm=warm)) as pool:
        reply = pool.call("broken", {}, timeout_s=5)
        assert reply.infra is not None and not reply.error and pool.stats.infra_failures == 1
