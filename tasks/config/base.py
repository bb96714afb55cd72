"""The base of every config model: unknown fields are errors, and each field's docstring is its help.

``use_attribute_docstrings`` turns the docstring under a field into its ``description``, so the one
text written where a field is declared reaches people three ways: the Prefect UI's forms (JSON schema
``description``), ``rlrounds config`` (a comment above the field) and validation errors
(``field_help`` appends it to pydantic's message).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

T = TypeVar("T")

Dtype = Literal["float32", "bfloat16", "float16", "auto"]
"""A precision an engine runs at: a choice in the UI's forms, and pydantic names the allowed values. 'auto':
bfloat16 where the engine serves on a GPU, float32 on the CPU (``models.device.engine_dtype``)."""


@dataclass(frozen=True)
class NotInput:
    """Marks what changes how fast, or where, something is computed, never what: a config field
    (``speculative: Annotated[SpeculativeConfig, NotInput("why")]``) or a stage function's parameter
    (``progress: Annotated[Callable | None, NotInput("a progress callback")]``).

    Such a field is left out of a campaign's identity, the round's config hash and every stage's resume key
    (flows/stages.py), so a resumed campaign may change it; such a parameter is left out of its stage's key.
    ``keyed_at_default``: keys recorded before the field was marked hold it, so it stays in the hash and the keys
    at its default value whatever it is set to, and those records still match (``round.device``)."""

    why: str
    keyed_at_default: bool = False


@dataclass(frozen=True)
class AddedInput:
    """Marks an input field added after campaigns were first recorded: a campaign's identity holds it only when it
    differs from its default, so a campaign recorded before the field existed still resumes (``rollout.stop``).

    ``keyed_at_default``: the config hash and the stage keys hold it whatever its value (the fields added before
    this flag existed, whose recorded keys hold them). False: they too leave it out while it is at its default, so
    the keys a round recorded before the field existed still match (``train.lora``)."""

    since: str
    """When the field was added (a date), for the reader."""
    keyed_at_default: bool = True


def marker(field: FieldInfo, kind: type[T]) -> T | None:
    """The ``kind`` marker a field declares (``Annotated[..., kind(...)]``), or None."""
    return next((m for m in field.metadata if isinstance(m, kind)), None)


class Config(BaseModel):
    """A stage's config. Every field is an input of what the stage computes unless it declares otherwise with a
    marker (``NotInput``, ``AddedInput``); the config hash, a campaign's identity and the stage keys all ask the
    markers, through ``inputs_dump`` and ``identity_dump``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    def inputs_dump(self) -> dict:
        """The config as a stage input (the config hash and the stage keys): ``model_dump(mode='json')`` without
        the ``NotInput`` fields, or with them at their defaults where they are ``keyed_at_default``, at any depth."""
        fields = type(self).model_fields
        dropped = {name for name, f in fields.items() if (m := marker(f, NotInput)) and not m.keyed_at_default}
        dropped |= {
            name
            for name, f in fields.items()
            if (added := marker(f, AddedInput)) and not added.keyed_at_default and self._input_at_default(name)
        }
        dump = self.model_dump(mode="json", exclude=dropped)
        for name in dump:
            value = getattr(self, name)
            if marker(fields[name], NotInput):
                dump[name] = to_jsonable_python(fields[name].default)
            elif isinstance(value, Config):
                dump[name] = value.inputs_dump()
        return dump

    def at_default(self, name: str) -> bool:
        """Whether field ``name`` holds its default value (compared as JSON)."""
        default = type(self).model_fields[name].get_default(call_default_factory=True)
        return to_jsonable_python(getattr(self, name)) == to_jsonable_python(default)

    def _input_at_default(self, name: str) -> bool:
        """Whether field ``name`` computes what its default computes: its value, or for a section its inputs (a
        section that differs only in its ``NotInput`` fields is at its default here)."""
        value = getattr(self, name)
        default = type(self).model_fields[name].get_default(call_default_factory=True)
        if isinstance(value, Config) and isinstance(default, Config):
            return value.inputs_dump() == default.inputs_dump()
        return self.at_default(name)

    def identity_dump(self) -> dict:
        """The config as part of a campaign's identity (what a resume must match): without the ``NotInput``
        fields, and without the ``AddedInput`` fields that are at their defaults, at any depth."""
        fields = type(self).model_fields
        dump = self.model_dump(mode="json", exclude={name for name, f in fields.items() if marker(f, NotInput)})
        for name in list(dump):
            value = getattr(self, name)
            if marker(fields[name], AddedInput) and self.at_default(name):
                del dump[name]
            elif isinstance(value, Config):
                dump[name] = value.identity_dump()
        return dump


def field_help(model: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    """The description of the field at ``loc`` (a validation error's location) under ``model``, or None.

    Walks nested models through their declared types (``RoundConfig | None`` included), one path
    element at a time; a location that leaves the models (a list index, a dict key) has no help."""
    current: Any = model
    described: str | None = None
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if not isinstance(part, str) or fields is None or part not in fields:
            return None
        field = fields[part]
        described = field.description
        current = model_in(field.annotation)
    return " ".join(described.split()) if described else None


def model_in(annotation: Any) -> Any:
    """The pydantic model an annotation holds (``X``, ``X | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
