"""The configuration reference, docs/configuration.md, generated from the config models themselves.

Every section of a campaign config and of the replay, re-filter and re-verify requests, each field with
its type, default and help (the docstring under it, as in `rlrounds config` and the Prefect forms).
tests/test_config.py fails when the committed file differs from what this writes; regenerate it with

    python -m flows.config_reference
"""

from __future__ import annotations

import enum
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from flows.config import CampaignConfig, ReplayRequest
from tasks.config.base import model_in
from tasks.config.refilter import RefilterRequest, ReverifyRequest

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
COMMAND = "python -m flows.config_reference"

HEADER = f"""# Configuration reference

Generated from the config models by `{COMMAND}`; do not edit by hand.
A campaign config file (YAML or JSON, `rlrounds run --config FILE`) holds the fields of the first
section, nested as the section names say; `rlrounds config` prints the defaults with this help as
comments. Unknown fields are errors.
"""

ROOTS: tuple[tuple[str, str, type[BaseModel]], ...] = (
    ("campaign", "`rlrounds run --config FILE`, the `rl-campaign` flow's parameter.", CampaignConfig),
    ("replay request", "`rlrounds replay`, the `rl-replay` flow's parameter.", ReplayRequest),
    ("refilter request", "`rlrounds refilter`, the `rl-refilter` flow's parameter.", RefilterRequest),
    ("reverify request", "`rlrounds reverify`, the `rl-reverify` flow's parameter.", ReverifyRequest),
)


def reference() -> str:
    """The whole reference as Markdown."""
    documented: dict[type[BaseModel], str] = {}  # model -> the section that documents it
    parts = [HEADER]
    for title, how, model in ROOTS:
        parts.append(f"\n## {title.capitalize()}\n\n{how}\n")
        parts += _sections(model, "", documented)
    return "".join(parts)


def _sections(model: type[BaseModel], path: str, documented: dict[type[BaseModel], str]) -> list[str]:
    """``model``'s section at ``path`` (dotted, '' at a campaign's top), then its nested models' sections."""
    documented[model] = path
    heading = f"\n### `{path}`\n\n" if path else "\n"
    lines = [heading, _one_line(model.__doc__ or ""), "\n\n| field | type | default | help |\n|---|---|---|---|\n"]
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, field in model.model_fields.items():
        inner = model_in(field.annotation)
        dotted = f"{path}.{name}" if path else name
        help_text = _one_line(field.description or "")
        if inner is not None and inner in documented:
            help_text += f" Fields: see `{documented[inner]}`." if documented[inner] else " Fields: see the campaign."
        elif inner is not None:
            nested.append((dotted, inner))
            help_text += f" Fields: see `{dotted}`."
        lines.append(f"| `{name}` | {_type(field)} | {_default(field, inner)} | {_cell(help_text)} |\n")
    sections = ["".join(lines)]
    for dotted, inner in nested:
        if inner not in documented:
            sections += _sections(inner, dotted, documented)
    return sections


def _type(field: FieldInfo) -> str:
    bounds = []
    for item in field.metadata:
        for kind, attribute, sign in ((Ge, "ge", ">="), (Gt, "gt", ">"), (Le, "le", "<="), (Lt, "lt", "<")):
            if isinstance(item, kind):
                bounds.append(f"{sign} {getattr(item, attribute)}")
    return _cell(", ".join([_type_name(field.annotation), *bounds]))


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(value) for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if origin is not None:
        args = ", ".join(_type_name(arg) for arg in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo, inner: type[BaseModel] | None) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "null"
    if inner is not None and isinstance(value, BaseModel):
        return "its defaults"
    if isinstance(value, enum.Enum):
        value = value.value
    return _cell(f"`{value!r}`")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    """Write the reference (or, with --check, exit 1 when the committed one differs)."""
    args = sys.argv[1:] if argv is None else argv
    text = reference()
    if "--check" in args:
        current = REFERENCE.read_text() if REFERENCE.exists() else ""
        if current != text:
            print(f"{REFERENCE} is out of date; run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    REFERENCE.parent.mkdir(exist_ok=True)
    REFERENCE.write_text(text)
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
