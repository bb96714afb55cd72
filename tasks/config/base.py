"""The base of every config model: unknown fields are errors, and each field's docstring is its help.

``use_attribute_docstrings`` turns the docstring under a field into its ``description``, so the one
text written where a field is declared reaches people three ways: the Prefect UI's forms (JSON schema
``description``), ``rlrounds config`` (a comment above the field) and validation errors
(``field_help`` appends it to pydantic's message).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

Dtype = Literal["float32", "bfloat16", "float16"]
"""A precision an engine runs at: a choice in the UI's forms, and pydantic names the allowed values."""


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    NOT_INPUTS: ClassVar[frozenset[str]] = frozenset()
    """Fields that change how fast a stage computes, or where, never what: left out of a stage's resume key and the
    round's config hash, so a resumed campaign may change them (``rollout.speculative``: its rows are plain
    sampling's)."""
    INPUTS_AT_DEFAULT: ClassVar[frozenset[str]] = frozenset()
    """The same kind of fields, but ones that keys recorded before ``NOT_INPUTS`` existed hold: they stay in the key
    at their default value whatever they are set to, so those records still match (``round.device``)."""

    def inputs_dump(self) -> dict:
        """The config as a stage input: ``model_dump(mode='json')`` without the ``NOT_INPUTS`` and with the
        ``INPUTS_AT_DEFAULT`` at their defaults, at any depth."""
        dump = self.model_dump(mode="json", exclude=self.NOT_INPUTS)
        fields = type(self).model_fields
        for name in self.INPUTS_AT_DEFAULT:
            dump[name] = fields[name].default
        for name in dump:
            value = getattr(self, name)
            if isinstance(value, Config) and name not in self.INPUTS_AT_DEFAULT:
                dump[name] = value.inputs_dump()
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
