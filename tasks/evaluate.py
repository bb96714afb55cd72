"""Evaluation: greedy held-out accuracy, at the precision and engine the policy will be served with.

Evaluating only at training precision hides the engine/trainer numeric gap; so every checkpoint is
scored on the serving engine and dtype, and (when they differ) on the training precision too, and
the gap is logged. The ``champion`` alias moves only when serving accuracy is not below the current
champion's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from models.engine import GroupRequest, SamplingParams
from tasks.verify import Outcome, get_verifier, run_verifier


class EvaluateConfig(BaseModel):
    """How published checkpoints are scored."""

    model_config = ConfigDict(extra="forbid")

    source: str | None = None
    """Held-out prompts (.jsonl/.parquet). Default: the built-in task's fixed 500 held-out prompts."""
    serving_engine: Literal["embedded"] = "embedded"
    """Engine the policy is served with; accuracy on it gates promotion."""
    serving_dtype: str = "float32"
    """Precision the policy is served at (e.g. bfloat16)."""
    max_tokens: int = Field(8, ge=1)
    """Most new tokens per greedy answer."""
    champion_alias: str = "champion"
    """Registry alias moved to a checkpoint whose serving accuracy is not below the current champion's."""


def accuracy(engine, tokenizer, prompts, verifier_name: str, max_tokens: int) -> dict[str, float]:
    """Greedy accuracy of ``engine`` on ``prompts``: share of samples the verifier scores as success."""
    verifier = get_verifier(verifier_name)
    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=max_tokens, seed=0)
    requests = [GroupRequest(p.prompt_id, tuple(tokenizer(p.text)["input_ids"]), 1, params) for p in prompts]
    by_id = {p.prompt_id: p for p in prompts}
    successes = infra = 0
    lengths = 0
    for sample in engine.generate(requests):
        text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        verdict = run_verifier(verifier, text, by_id[sample.group_id].reference)
        successes += verdict.outcome == Outcome.SUCCESS
        infra += verdict.outcome == Outcome.INFRA_FAILURE
        lengths += len(sample.token_ids)
    scored = max(len(prompts) - infra, 1)  # infra failures are not the policy's errors
    return {"accuracy": successes / scored, "prompts": len(prompts), "infra_failures": infra, "mean_tokens": lengths / max(len(prompts), 1)}


def evaluate_checkpoint(local_dir: str, prompts, verifier_name: str, config: EvaluateConfig, train_dtype: str = "float32") -> dict[str, float | str]:
    """Score a local checkpoint on the serving engine/dtype and, if different, the training precision."""
    from tasks.engines import make_engine

    engine, tokenizer = make_engine(config.serving_engine, local_dir, config.serving_dtype, policy_version=0)
    serving = accuracy(engine, tokenizer, prompts, verifier_name, config.max_tokens)
    out: dict[str, float | str] = {
        "eval/accuracy": serving["accuracy"],
        "eval/prompts": serving["prompts"],
        "eval/infra_failures": serving["infra_failures"],
        "eval/mean_tokens": serving["mean_tokens"],
        "eval/engine": engine.info.name,
        "eval/dtype": engine.info.dtype,
    }
    if (config.serving_engine, config.serving_dtype) != ("embedded", train_dtype):
        train_engine, _ = make_engine("embedded", local_dir, train_dtype, policy_version=0)
        at_train = accuracy(train_engine, tokenizer, prompts, verifier_name, config.max_tokens)["accuracy"]
        out["eval/accuracy_train_precision"] = at_train
        out["eval/serving_gap"] = serving["accuracy"] - at_train
    else:
        out["eval/accuracy_train_precision"] = serving["accuracy"]
        out["eval/serving_gap"] = 0.0
    return out


# -- the stage ------------------------------------------------------------------------------------

def run_evaluate(ctx, config: EvaluateConfig, prompts_config, verifier_name: str, checkpoint_uri: str,
                 model_version: str | None, train_dtype: str = "float32") -> dict:
    """Score the checkpoint, record it on the round's run and the model version, apply the champion gate."""
    from storage import checkpoints
    from storage.lineage import Tracker
    from storage.paths import StorageRoot
    from storage.settings import settings
    from tasks.prompts import evaluation_prompts

    root = StorageRoot.of(ctx.storage)
    local = checkpoints.local_copy(root, checkpoint_uri)
    prompts = evaluation_prompts(prompts_config, config.source)
    result = evaluate_checkpoint(local, prompts, verifier_name, config, train_dtype)
    tracker = Tracker.connect(settings(), root)
    promoted = False
    if model_version:
        name, version = model_version.split("/")
        tracker.tag_model_version(name, version, {
            "eval.accuracy": result["eval/accuracy"],
            "eval.accuracy_train_precision": result["eval/accuracy_train_precision"],
            "eval.serving_gap": result["eval/serving_gap"],
            "eval.engine": result["eval/engine"],
            "eval.dtype": result["eval/dtype"],
            "eval.prompts": result["eval/prompts"],
        })
        champion = tracker.alias_version(name, config.champion_alias)
        best = float(tracker.model_version(name, champion).tags.get("eval.accuracy", "-1")) if champion else -1.0
        if result["eval/accuracy"] >= best:
            tracker.set_alias(name, config.champion_alias, version)
            promoted = True
    return {**result, "eval/promoted": float(promoted)}


from prefect import task  # noqa: E402 -- the thin Prefect wrapper stays at the bottom
from prefect.cache_policies import NO_CACHE  # noqa: E402

evaluate_task = task(name="evaluate", cache_policy=NO_CACHE)(run_evaluate)
