"""Tools declared as plain Python functions, shown to the policy, and parsed back out of its text.

A tool is a function: its name is the tool's name, its docstring's first paragraph the description, its typed
parameters the arguments (a JSON schema made from the annotations; an ``Args:`` section of the docstring, one
``name: text`` line each, describes them). It runs in a sandbox (tasks/environments/tool_pool.py), sent there as
its own source, so a tool is self-contained: it imports what it needs inside its body (stdlib only) and uses no
module globals.

The policy sees the tools through its tokenizer's chat template (``apply_chat_template(..., tools=...)``)
where the template renders them, else as a plain-text list in the system turn. It calls one by writing

    <tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>

(the JSON form chat templates with tool support teach), which ``parse_tool_call`` reads back.
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_JSON_TYPES: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}


def json_schema_of(annotation: Any) -> dict:
    """The JSON schema of one parameter's annotation: scalars, list[...], dict[str, ...], Literal[...], X | None."""
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (list, tuple, Sequence, set, frozenset):
        return {"type": "array", "items": json_schema_of(args[0])} if args else {"type": "array"}
    if origin is dict or annotation is dict:
        return {"type": "object"}
    if annotation is list:
        return {"type": "array"}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [json_schema_of(a) for a in args]}
    raise TypeError(f"a tool argument annotated {annotation!r} has no JSON form; use int, float, str, bool, list, dict")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(description: the first paragraph, {argument: its line in an ``Args:`` section})."""
    doc = inspect.cleandoc(doc)
    description = doc.split("\n\n")[0].replace("\n", " ").strip()
    args: dict[str, str] = {}
    section = re.search(r"^Args:\s*\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
    if section:
        for line in section.group(1).splitlines():
            name, sep, text = line.strip().partition(":")
            if sep:
                args[name.split(" ")[0]] = text.strip()
    return description, args


@dataclass(frozen=True)
class Tool:
    """One tool: what the policy is shown (name, description, parameters) and what the sandbox runs (source)."""

    name: str
    description: str
    parameters: dict
    """JSON schema of the arguments object."""
    source: str
    """The function's own source, loaded once by each sandbox template."""

    @classmethod
    def from_function(cls, function: Callable) -> Tool:
        name = function.__name__
        if not function.__doc__:
            raise ValueError(f"tool {name} has no docstring: the policy is shown it as the tool's description")
        description, arg_docs = _docstring_parts(function.__doc__)
        hints = typing.get_type_hints(function)
        properties, required = {}, []
        for param in inspect.signature(function).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise ValueError(f"tool {name}: *args and **kwargs have no schema; name every argument")
            if param.name not in hints:
                raise ValueError(f"tool {name}: argument {param.name} has no type annotation")
            schema = json_schema_of(hints[param.name])
            if param.name in arg_docs:
                schema["description"] = arg_docs[param.name]
            properties[param.name] = schema
            if param.default is param.empty:
                required.append(param.name)
        parameters = {"type": "object", "properties": properties, "required": required}
        return cls(name, description, parameters, textwrap.dedent(inspect.getsource(function)))

    def schema(self) -> dict:
        """The OpenAI-style function schema chat templates take in ``tools=``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def tools_source(tools: Sequence[Tool]) -> str:
    """One module's source defining every tool, as a sandbox template loads it."""
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must be unique, got {names}")
    return "\n\n".join(t.source for t in tools)


def plain_tool_list(tools: Sequence[Tool]) -> str:
    """The tools as text, for a template that does not render ``tools=`` (or no template)."""
    lines = ["You can call these tools:"]
    for t in tools:
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in t.parameters["properties"].items())
        lines.append(f"- {t.name}({args}): {t.description}")
    lines.append('Call one as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>')
    return "\n".join(lines)


def render_with_tools(tokenizer: Any, messages: list[dict], tools: Sequence[Tool]) -> str:
    """The prompt text: ``messages`` through the chat template with ``tools=`` when it renders them (its output
    changes with them), else with the plain-text tool list added to the system turn (or as one); without a
    chat template, the turns' contents joined, the tool list first."""
    listing = plain_tool_list(tools)
    if getattr(tokenizer, "chat_template", None):
        bare = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if tools:
            with_tools = tokenizer.apply_chat_template(
                messages, tools=[t.schema() for t in tools], tokenize=False, add_generation_prompt=True
            )
            if with_tools != bare:
                return with_tools
        else:
            return bare
        if messages and messages[0]["role"] == "system":
            messages = [{"role": "system", "content": f"{messages[0]['content']}\n\n{listing}"}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": listing}, *messages]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    contents = [m["content"] for m in messages]
    return "\n".join([listing, *contents] if tools else contents)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


class ToolCallError(ValueError):
    """The policy's text tried to call a tool but the call cannot be read (the model's failure to follow the
    format; reported back to it as the observation)."""


_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_tool_call(text: str) -> ToolCall | None:
    """The first tool call in the policy's text, None if it makes none. Raises ``ToolCallError`` for a call that
    is not ``{"name": str, "arguments": object}`` JSON."""
    match = _CALL.search(text)
    if match is None:
        return None
    try:
        body = json.loads(match.group(1).strip())
    except ValueError as exc:
        raise ToolCallError(f"the tool call is not JSON: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        raise ToolCallError('a tool call is {"name": str, "arguments": {...}}')
    arguments = body.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ToolCallError("a tool call's arguments are a JSON object")
    return ToolCall(body["name"], arguments)
