"""Presets: campaign configs shipped with the package (``flows/presets/<name>.yaml``).

``rlrounds run --preset NAME`` starts from the preset; a ``--config FILE`` given too is laid over it
field by field (nested sections merge, a value in the file replaces the preset's), and command-line
flags (``--rounds``, ``--run-id``) apply last. ``rlrounds config --preset NAME`` prints the result.
"""

from __future__ import annotations

from importlib import resources

import yaml

SUFFIX = ".yaml"


class PresetError(ValueError):
    pass


def preset_names() -> list[str]:
    folder = resources.files("flows") / "presets"
    return sorted(p.name.removesuffix(SUFFIX) for p in folder.iterdir() if p.name.endswith(SUFFIX))


def load_preset(name: str) -> dict:
    """The preset's fields as a mapping; an unknown name fails in one line listing the known ones."""
    known = preset_names()
    if name not in known:
        raise PresetError(f"no preset named {name!r}; use one of: {', '.join(known)}")
    data = yaml.safe_load((resources.files("flows") / "presets" / f"{name}{SUFFIX}").read_text()) or {}
    if not isinstance(data, dict):  # a packaging mistake, not the user's
        raise PresetError(f"preset {name!r} must hold a mapping of fields, not {type(data).__name__}")
    return data


def overlay(base: dict, over: dict) -> dict:
    """``over`` laid on ``base``: mappings merge key by key, any other value in ``over`` replaces."""
    out = dict(base)
    for key, value in over.items():
        out[key] = overlay(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
