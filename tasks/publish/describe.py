"""A registered model version's description: what a person auditing it in the MLflow UI reads first.

The tags stay the machine-readable record (queries, ``rlrounds lineage``); the description says the
same in a few lines of markdown: the round, its parent (a link to that version's page), the trajectory
version it was trained on and how that version came to be, the evaluation at serving and training
precision, and the Prefect flow run that produced it when a Prefect server is known.
"""

from __future__ import annotations

import os
from typing import Any

from storage.model_versions import LineageError, parse_model_version
from storage.trajectories import TrajectoryStoreError, find_version


def prefect_ui_url() -> str | None:
    """The Prefect UI's base URL: PREFECT_UI_URL, else PREFECT_API_URL without its ``/api`` suffix.

    None without either (an ephemeral API: its flow runs are gone when the process ends). Read from
    the environment (a worker hands PREFECT_API_URL to the flow runs it starts), so tasks/ stays free
    of Prefect imports."""
    ui = os.environ.get("PREFECT_UI_URL") or os.environ.get("PREFECT_API_URL")
    return ui.rstrip("/").removesuffix("/api") if ui else None


def _version_link(ref: str) -> str:
    """A link to another version's page in the MLflow UI (relative, so it works behind any host)."""
    try:
        name, version = parse_model_version(ref)
    except LineageError:
        return f"`{ref}`"
    return f"[{ref}](#/models/{name}/versions/{version})"


def _percent(tags: dict[str, str], key: str) -> str:
    value = tags.get(key)
    try:
        return f"{float(value):.1%}"
    except (TypeError, ValueError):
        return "n/a"


def trajectory_origin(manifest_body: dict[str, Any] | None) -> str:
    """How a trajectory version came to be, in words, from its manifest (None: not found)."""
    if manifest_body is None:
        return "not found in the storage root"
    derivation = manifest_body.get("derivation") or {}
    parent = manifest_body.get("parent")
    if parent:
        how = []
        if derivation.get("where"):
            how.append(f"rows where `{derivation['where']}`")
        if derivation.get("regroup"):
            how.append("regrouped")
        if derivation.get("reverify"):
            again = derivation["reverify"]
            how.append(f"{again.get('rows', '?')} rows verified again where `{again.get('where')}`")
        detail = ", ".join(how) or "derived"
        return f"derived from `{parent}` ({detail})"
    return f"collected by round {manifest_body.get('round', '?')} of campaign `{manifest_body.get('run_id', '?')}`"


def version_description(ref: str, tags: dict[str, str], trajectory: str | None, flow_run_url: str | None) -> str:
    """The markdown description of model version ``ref`` ('NAME/VERSION') from its tags.

    ``trajectory``: how its trajectory version came to be (``trajectory_origin``); ``flow_run_url``:
    the Prefect flow run's page, or None."""
    round_index = tags.get("round", "?")
    kind = "replay" if tags.get("kind") == "replay" else "round"
    campaign, base = tags.get("run_id", "?"), tags.get("base_model", "?")
    lines = [f"**{ref}**: {kind} {round_index} of campaign `{campaign}`, base `{base}`.", ""]
    parent = tags.get("parent_model_version", "none")
    lines.append(f"- Parent: {'none (the base policy)' if parent == 'none' else _version_link(parent)}")
    version = tags.get("trajectory_version", "none")
    if version == "none":
        lines.append("- Trajectories: none (not trained here)")
    else:
        lines.append(f"- Trajectories: `{version}`, {trajectory or 'origin unknown'}")
    if "eval.accuracy" in tags:
        lines.append(
            f"- Evaluation: {_percent(tags, 'eval.accuracy')} held-out accuracy at serving precision "
            f"({tags.get('eval.engine', '?')}, {tags.get('eval.dtype', '?')}); "
            f"{_percent(tags, 'eval.accuracy_train_precision')} at training precision; "
            f"over {tags.get('eval.prompts', '?').split('.')[0]} prompts"
        )
    else:
        lines.append("- Evaluation: not evaluated")
    if flow_run_url:
        lines.append(f"- Prefect flow run: [{tags.get('prefect_flow_run_id', 'flow run')}]({flow_run_url})")
    lines.append(f"- Config hash `{tags.get('config_hash', '?')}`, code `{tags.get('code_version', '?')}`")
    return "\n".join(lines) + "\n"


def describe_version(tracker, root, ref: str) -> str:
    """Write ``ref``'s description from its current tags (called once it is evaluated); returns it."""
    name, version = parse_model_version(ref)
    tags = dict(tracker.model_version(name, version).tags)
    trajectory = None
    if tags.get("trajectory_version", "none") != "none":
        try:
            known = tags.get("round", "").isdigit() and "run_id" in tags
            near = (tags["run_id"], int(tags["round"])) if known else None  # the round its lineage names
            trajectory = trajectory_origin(find_version(root, tags["trajectory_version"], near).body)
        except TrajectoryStoreError:
            trajectory = trajectory_origin(None)
    run_id = tags.get("prefect_flow_run_id", "none")
    ui = prefect_ui_url()
    url = f"{ui}/runs/flow-run/{run_id}" if ui and run_id not in ("", "none") else None
    text = version_description(ref, tags, trajectory, url)
    tracker.client.update_model_version(name, version, description=text)
    return text
