"""Lineage audit: from a registered model version back to the base policy, one step per checkpoint.

Reads only the MLflow registry (each model version's lineage tags: ``parent_model_version``,
``trajectory_version``, ``config_hash``, ``code_version``, ``prefect_flow_run_id``, ``line``, ``eval.*``) and the
trajectory manifests (how each trajectory version was derived). No run, checkpoint or Prefect server
has to be alive for an audit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from storage.model_versions import LineageError, parse_model_version
from storage.paths import StorageRoot
from storage.tracking import LINE_TAG, checkpoint_uri
from storage.trajectories import TrajectoryStoreError, find_version

NO_PARENT = "none"


class AuditError(LineageError):
    pass


@dataclass
class LineageStep:
    model_version: str
    round: str
    kind: str
    """'base' (registered as round 0), 'round' (trained by a campaign round) or 'replay'."""
    run_id: str
    parent_model_version: str
    trajectory_version: str
    derivation: list[dict] = field(default_factory=list)
    """The trajectory version and its ancestors, nearest first (empty for the base)."""
    config_hash: str = ""
    code_version: str = ""
    prefect_flow_run_id: str = ""
    base_model: str = ""
    checkpoint: str = ""
    evaluation: dict[str, str] = field(default_factory=dict)
    line: str = ""
    """The promotion line the version belongs to (empty for versions registered before lines existed)."""
    aliases: list[str] = field(default_factory=list)
    """Registry aliases the version holds now, e.g. ['champion'] for its line's champion."""


def derivation_of(root: StorageRoot, trajectory_version: str, limit: int = 100) -> list[dict]:
    """What each manifest in the version's chain says about how it was made, nearest first."""
    out: list[dict] = []
    version: str | None = trajectory_version
    while version and version != NO_PARENT and len(out) < limit:
        try:
            manifest = find_version(root, version)
        except TrajectoryStoreError as exc:
            out.append({"version": version, "kind": "missing", "error": str(exc)})
            break
        d = manifest.derivation
        entry: dict[str, Any] = {
            "version": manifest.version,
            "kind": manifest.kind,
            "run_id": manifest.body.get("run_id"),
            "round": manifest.body.get("round"),
            "rows": manifest.rows,
            "uri": manifest.directory,
        }
        if manifest.parent:
            entry.update(parent=manifest.parent, where=d.get("where"), regroup=d.get("regroup", False))
        else:
            entry.update(
                target_groups=d.get("target_groups"), policy_version=d.get("policy_version"), filter=d.get("filter")
            )
        out.append(entry)
        version = manifest.parent
    return out


def walk(tracker: Any, root: StorageRoot, ref: str, limit: int = 10_000) -> list[LineageStep]:
    """Follow ``parent_model_version`` tags from ``ref`` to the version whose parent is 'none'."""
    steps: list[LineageStep] = []
    seen: set[str] = set()
    current = ref
    while current != NO_PARENT:
        if current in seen or len(steps) >= limit:
            raise AuditError(
                f"lineage of {ref} loops at {current}; the registry's parent_model_version tags are inconsistent"
            )
        seen.add(current)
        name, version = parse_model_version(current)
        try:
            mv = tracker.model_version(name, version)
        except Exception as exc:  # noqa: BLE001 -- MLflow raises its own types for a missing version
            where = "" if not steps else f" (parent of {steps[-1].model_version})"
            raise AuditError(
                f"no registered model version {current}{where}: {str(exc).splitlines()[0] if str(exc) else exc}"
            ) from None
        tags = dict(mv.tags or {})
        parent = tags.get("parent_model_version", NO_PARENT)
        trajectory = tags.get("trajectory_version", NO_PARENT)
        steps.append(
            LineageStep(
                model_version=current,
                round=tags.get("round", "?"),
                kind=tags.get("kind") or ("base" if parent == NO_PARENT else "round"),
                run_id=tags.get("run_id", ""),
                parent_model_version=parent,
                trajectory_version=trajectory,
                derivation=derivation_of(root, trajectory) if trajectory != NO_PARENT else [],
                config_hash=tags.get("config_hash", ""),
                code_version=tags.get("code_version", ""),
                prefect_flow_run_id=tags.get("prefect_flow_run_id", ""),
                base_model=tags.get("base_model", ""),
                checkpoint=checkpoint_uri(mv),
                evaluation={k.removeprefix("eval."): v for k, v in sorted(tags.items()) if k.startswith("eval.")},
                line=tags.get(LINE_TAG, ""),
                aliases=sorted(getattr(mv, "aliases", None) or []),
            )
        )
        current = parent
    return steps


# -- presentation ---------------------------------------------------------------------------------


def describe_derivation(chain: list[dict]) -> str:
    if not chain:
        return "none (the base policy: not trained on rlrounds trajectories)"
    parts = []
    for entry in chain:
        if entry["kind"] == "missing":
            parts.append(f"{entry['version']} (manifest not found)")
        elif entry.get("parent"):
            regroup = ", regrouped" if entry.get("regroup") else ""
            parts.append(f"{entry['version']} derived where {entry.get('where')!r}{regroup}: {entry['rows']} rows")
        else:
            parts.append(
                f"{entry['version']} {entry['kind']} of run {entry['run_id']} round {entry['round']}: "
                f"{entry['rows']} rows, "
                f"target {entry.get('target_groups')} groups, sampled by policy version {entry.get('policy_version')}"
            )
    return " <- ".join(parts)


def describe_evaluation(evaluation: dict[str, str]) -> str:
    if "accuracy" not in evaluation:
        return "not evaluated"
    try:
        text = f"accuracy {float(evaluation['accuracy']):.1%}"
    except ValueError:
        text = f"accuracy {evaluation['accuracy']}"
    text += (
        f" ({evaluation.get('engine', '?')} {evaluation.get('dtype', '?')}, {evaluation.get('prompts', '?')} prompts)"
    )
    at_train = evaluation.get("accuracy_train_precision")
    if at_train is not None and at_train != evaluation["accuracy"]:
        text += f"; at training precision {at_train}"
    return text


def format_lineage(steps: list[LineageStep]) -> str:
    trained = sum(1 for s in steps if s.kind != "base")
    base = steps[-1].base_model if steps else "?"
    lines = [f"lineage of {steps[0].model_version}: {trained} trained step(s) back to the base {base}", ""]
    for s in steps:
        what = "base policy" if s.kind == "base" else f"{s.kind} of run {s.run_id}"
        lines += [
            f"{s.model_version}  round {s.round}  ({what})",
            f"  trajectories  {describe_derivation(s.derivation)}",
            f"  config        {s.config_hash}    code {s.code_version}",
            f"  prefect run   {s.prefect_flow_run_id}",
            f"  evaluation    {describe_evaluation(s.evaluation)}",
            f"  line          {s.line or 'not recorded'}{''.join(f'  [{a}]' for a in s.aliases)}",
            f"  checkpoint    {s.checkpoint}",
            f"  parent        {s.parent_model_version}",
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"


def to_json(steps: list[LineageStep]) -> list[dict]:
    return [asdict(s) for s in steps]
