"""Replay: train on a stored trajectory version from a registered checkpoint, and publish the result.

A replay is a round without rollout. The parent is a registered model version (its ``source`` is the
checkpoint URI, optimizer state included); the data is a committed trajectory version (a round's own
or a derived one); the training code is the round's own (tasks/train.run_train). Replaying round k's
trajectories from round k's parent with round k's training config therefore reproduces round k's
weights bit for bit on CPU: same weights, same optimizer state, same rows in the same order, same seed.

The sampling temperature and engine precision are read from the trajectory rows (the behaviour
logprobs were recorded under them), never from a config that might disagree with them. Without a
training config, the one recorded in the checkpoint lineage of the round that produced the rows is used.

The result is registered under the parent's model name with the usual lineage tags plus
``kind=replay``. Its run id is ``replay-<hash of its inputs>``, so running the same replay twice trains
once and registers once. It is evaluated (``eval.*`` tags) but never moves the champion alias: a
replay is an experiment, not a promotion.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated

from storage import checkpoints
from storage.model_versions import LineageError, parse_model_version
from storage.paths import StorageRoot
from storage.settings import settings
from storage.tracking import KIND_TAG, RUN_ID_TAG, Tracker, checkpoint_uri
from storage.trajectories import find_version, parent_chain, read_table
from tasks.config.base import AddedInput
from tasks.config.environment import EpisodeConfig
from tasks.config.evaluate import EvaluateConfig
from tasks.config.prompts import PromptsConfig
from tasks.config.train import TrainConfig
from tasks.config.verify import VerifyConfig
from tasks.evaluate.stage import evaluate_checkpoint, evaluation_tags
from tasks.prompts.sources import evaluation_prompts
from tasks.publish.describe import describe_version
from tasks.publish.stage import lineage_tags
from tasks.round.context import RoundContext
from tasks.round.results import Published, StageResult, Stats

REPLAY_KIND = "replay"


class ReplayError(LineageError):
    pass


class ReplayPlan(StageResult):
    """Everything the train and publish steps of a replay need, resolved once."""

    replay_id: str
    context: RoundContext
    trajectory_version: str
    trajectory_uri: str
    train: TrainConfig
    temperature: float
    rollout_dtype: str
    checkpoint: str
    model_name: str
    line: str
    """Promotion line of the config the replay is evaluated with (tagged; a replay never gates)."""
    source: dict
    """Run and round of the rollout the trajectories came from."""

    @property
    def lineage_extra(self) -> dict:
        return {"kind": REPLAY_KIND, "replay_id": self.replay_id, "replay_of": self.source}


def replay_id(trajectory_version: str, from_model: str, train: TrainConfig, model_name: str, code_version: str) -> str:
    """Same inputs, same id: a repeated replay finds its committed checkpoint and registered version."""
    canonical = json.dumps(
        [trajectory_version, from_model, train.model_dump(mode="json"), model_name, code_version], sort_keys=True
    )
    return "replay-" + hashlib.sha256(canonical.encode()).hexdigest()[:12]


def only_value(values: list, what: str, version: str):
    """The one value a column holds across a version's rows (temperature, dtype, task)."""
    distinct = sorted({v for v in values if v is not None}, key=str)
    if len(distinct) != 1:
        raise ReplayError(
            f"trajectory version {version} holds {len(distinct)} different {what} values ({distinct[:4]}); "
            "replay needs one: select one with `rlrounds refilter` first"
        )
    return distinct[0]


def recorded_training(root, rollout_manifest) -> tuple[TrainConfig, str]:
    """The training config and config hash of the round that trained on this rollout version."""
    run_id, round_index = rollout_manifest.body.get("run_id"), rollout_manifest.body.get("round")
    if run_id is None or round_index is None:
        raise ReplayError(
            f"trajectory version {rollout_manifest.version} names no round; pass --config with a training config"
        )
    try:
        lineage = checkpoints.read_lineage(root, root.checkpoint(run_id, round_index))
    except checkpoints.CheckpointError:
        raise ReplayError(
            f"no training config is recorded for run {run_id} round {round_index} (its checkpoint is not "
            "committed); pass --config with the campaign config the round ran with"
        ) from None
    return TrainConfig.recorded(lineage["train_config"]), lineage["config_hash"]


# -- the stages -----------------------------------------------------------------------------------


def run_plan_replay(
    *,
    storage: str,
    trajectories: str,
    from_model: str,
    train: TrainConfig | None,
    config_hash: str | None,
    model_name: str | None,
    task: str,
    line: str,
    code_version: str,
    flow_run_id: str,
) -> ReplayPlan:
    """Resolve the parent model version and the trajectory version; open the replay's MLflow run."""
    root = StorageRoot.of(storage)
    tracker = Tracker.connect(settings(), root)
    name, version = parse_model_version(from_model)
    try:
        parent = tracker.model_version(name, version)
    except Exception as exc:  # noqa: BLE001 -- MLflow raises its own types for a missing version
        raise ReplayError(
            f"no registered model version {from_model}: {str(exc).splitlines()[0] if str(exc) else exc}"
        ) from None
    tags = dict(parent.tags or {})
    manifest = find_version(root, trajectories)
    chain = parent_chain(root, manifest)
    if train is None:
        train, config_hash = recorded_training(root, chain[-1])
    table = read_table(root, manifest, columns=["sampling", "engine", "task"])
    temperature = only_value(
        [s["temperature"] for s in table.column("sampling").to_pylist()], "sampling temperature", manifest.version
    )
    dtype = only_value([e["dtype"] for e in table.column("engine").to_pylist()], "engine dtype", manifest.version)
    found_task = only_value(table.column("task").to_pylist(), "task", manifest.version)
    if found_task != task:
        raise ReplayError(
            f"trajectory version {manifest.version} is task {found_task!r} but the replay evaluates task {task!r}; "
            "pass --config with the campaign config the round ran with"
        )
    model_name = model_name or name
    rid = replay_id(manifest.version, from_model, train, model_name, code_version)
    experiment_id = (
        tracker.client.get_run(parent.run_id).info.experiment_id if parent.run_id else tracker.experiment_id("rlrounds")
    )
    run = tracker.ensure_run(experiment_id, rid, {RUN_ID_TAG: rid, KIND_TAG: REPLAY_KIND})
    params = {
        "trajectory_version": manifest.version,
        "from_model": from_model,
        "config_hash": config_hash,
        "train_config": json.dumps(train.model_dump(mode="json"), sort_keys=True),
    }
    logged = tracker.client.get_run(run).data.params  # MLflow params are write-once: a repeated replay adds none
    tracker.log(run, params={k: v for k, v in params.items() if k not in logged})
    parent_round = int(tags.get("round", "0"))
    context = RoundContext(
        storage=storage,
        run_id=rid,
        round=parent_round + 1,
        experiment=tracker.client.get_experiment(experiment_id).name,
        parent_checkpoint=checkpoint_uri(parent),
        parent_policy_version=parent_round,
        parent_model_version=from_model,
        base_model=tags.get("base_model", "unknown"),
        config_hash=config_hash or "unknown",
        code_version=code_version,
        flow_run_id=flow_run_id,
        mlflow_run_id=run,
        seed=train.seed,
    )
    return ReplayPlan(
        replay_id=rid,
        context=context,
        trajectory_version=manifest.version,
        trajectory_uri=manifest.directory,
        train=train,
        temperature=float(temperature),
        rollout_dtype=str(dtype),
        checkpoint=root.replay_checkpoint(rid),
        model_name=model_name,
        line=line,
        source={"run_id": chain[-1].body.get("run_id"), "round": chain[-1].body.get("round")},
    )


def run_publish_replay(
    *,
    plan: ReplayPlan,
    checkpoint: str,
    train_stats: Stats,
    evaluate: EvaluateConfig | None,
    prompts: PromptsConfig,
    verify: VerifyConfig,
    device: str = "auto",
    environment: Annotated[str | None, AddedInput(since="2026-12-04", keyed_at_default=False)] = None,
    episode: Annotated[EpisodeConfig | None, AddedInput(since="2026-12-04", keyed_at_default=False)] = None,
) -> Published:
    """Register the replayed checkpoint with its lineage; evaluate it on ``device`` (tags only, no champion move)."""
    ctx = plan.context
    root = StorageRoot.of(ctx.storage)
    tracker = Tracker.connect(settings(), root)
    tracker.log_dataset(
        ctx.mlflow_run_id, f"trajectories-{plan.trajectory_version}", plan.trajectory_version, plan.trajectory_uri
    )
    tags = lineage_tags(ctx, trajectory_version=plan.trajectory_version, line=plan.line)
    version = tracker.register(plan.model_name, checkpoint, ctx.mlflow_run_id, {**tags, "kind": REPLAY_KIND})
    scores = None
    if evaluate is not None:
        held_out = evaluation_prompts(prompts, evaluate.source)
        local = checkpoints.local_copy(root, checkpoint)
        scores = evaluate_checkpoint(
            local, held_out, verify, evaluate, device=device, environment=environment, episode=episode
        )
        tracker.tag_model_version(plan.model_name, version, evaluation_tags(scores))
    describe_version(tracker, root, f"{plan.model_name}/{version}")
    evaluation = scores.metrics() if scores is not None else {}
    numeric = {k: float(v) for k, v in {**train_stats, **evaluation}.items() if isinstance(v, (int, float))}
    tracker.log(ctx.mlflow_run_id, metrics=numeric, step=ctx.round)
    tracker.finish(ctx.mlflow_run_id)
    return Published(
        model_version=f"{plan.model_name}/{version}", stats=numeric, accuracy=scores.accuracy if scores else None
    )
