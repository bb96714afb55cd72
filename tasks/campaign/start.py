"""Where a round starts: a model the user knows, resolved through the registry.

``NAME@ALIAS`` (``rlrounds-addition@champion``), ``NAME/VERSION`` (``rlrounds-addition/3``) or ``base``
(the config's policy.base_model). Everything internal a round needs (the parent's checkpoint URI, its
policy version, the base it descends from) is read from the registered version, never typed by hand.
"""

from __future__ import annotations

import re

from storage.model_versions import LineageError
from storage.paths import StorageRoot
from storage.settings import settings
from storage.tracking import Tracker
from tasks.round.results import StageResult

BASE = "base"
_REF = re.compile(r"^(?P<name>[^/@']+)(?:@(?P<alias>[A-Za-z0-9_-]+)|/(?P<version>\d+))$")


class StartPoint(StageResult):
    """A registered model version a round starts from."""

    model_version: str
    """'NAME/VERSION' (an alias resolved to the version it points at now)."""
    checkpoint: str
    """URI of its committed checkpoint (the version's source)."""
    round: int
    """Its round (policy version): the new round is this plus one."""
    base_model: str
    """The base it descends from (its base_model tag)."""


def parse_start(ref: str) -> tuple[str, str | None, str | None]:
    """(name, alias, version) of 'NAME@ALIAS' or 'NAME/VERSION'; the error names the accepted forms."""
    match = _REF.match(ref.strip())
    if not match:
        raise LineageError(
            f"start {ref!r} is not a model reference; use 'base', NAME@ALIAS (e.g. rlrounds-addition@champion) "
            "or NAME/VERSION (e.g. rlrounds-addition/3)"
        )
    return match["name"], match["alias"], match["version"]


def run_resolve_start(*, storage: str, start: str) -> StartPoint:
    """The registered version ``start`` names now (not 'base', which the flow builds instead)."""
    name, alias, version = parse_start(start)
    tracker = Tracker.connect(settings(), StorageRoot.of(storage), must_exist=True)
    if alias:
        version = tracker.alias_version(name, alias)
        if version is None:
            raise LineageError(
                f"no version of {name!r} carries the alias {alias!r}; run a campaign first, or start from NAME/VERSION"
            )
    registered = tracker.registered_version(name, version)
    tags = registered.tags
    if not str(tags.get("round", "")).isdigit():
        raise LineageError(f"{name}/{version} has no round tag; start from a version registered by rlrounds")
    return StartPoint(
        model_version=f"{name}/{version}",
        checkpoint=registered.source,
        round=int(tags["round"]),
        base_model=tags.get("base_model", "unknown"),
    )
