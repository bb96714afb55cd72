"""Evaluation: greedy held-out accuracy, at the precision and engine the policy will be served with.

Evaluating only at training precision hides the engine/trainer numeric gap; so every checkpoint is
scored on the serving engine and dtype (by default the embedded engine at bfloat16, the precision a
policy is usually served at), and on the training precision too when they differ, and the gap is
logged. Accuracy is successes over every held-out prompt: a prompt the verifier could not score
(infra_failure) is not a success, so a flaky environment can only lower it, never inflate it.

The champion gate: a round's checkpoint takes the ``champion`` alias only when its serving accuracy
is not below the champion's at the same engine and dtype. A champion never scored there is scored
first, so the comparison is always like with like; a champion of another promotion line (another task
or held-out set, the ``line`` tag) is never compared with, and the round fails naming the fix.
Replays and ``rlrounds eval`` never move the alias.
"""

from __future__ import annotations

from typing import Annotated

from models.engines.types import greedy_completions
from storage import checkpoints
from storage.files import lease
from storage.model_versions import LineageError, parse_model_version
from storage.paths import StorageRoot
from storage.settings import settings
from storage.tracking import LINE_TAG, Tracker, checkpoint_uri
from tasks.config.evaluate import EvaluateConfig
from tasks.config.prompts import PromptsConfig
from tasks.config.verify import VerifyConfig
from tasks.context import RoundContext
from tasks.describe import describe_version
from tasks.engines import close_engine, make_engine, serving_engine
from tasks.prompts import evaluation_prompts
from tasks.results import Evaluation, NotInput, Stats, VersionEvaluation
from tasks.verifiers.outcome import Outcome, Verifier
from tasks.verifiers.pool import run_verifier
from tasks.verifiers.registry import get_verifier


def accuracy(engine, tokenizer, prompts, verifier: Verifier, max_tokens: int) -> dict[str, float]:
    """Greedy accuracy of ``engine`` on ``prompts``: share of prompts the verifier scores as success.

    An infrastructure failure counts as not a success (and is reported): leaving it out of the
    denominator would let a flaky verifier raise accuracy, and with it promote a checkpoint."""
    successes = infra = lengths = 0
    for prompt, text, tokens in greedy_completions(engine, tokenizer, prompts, max_tokens):
        verdict = run_verifier(verifier, text, prompt.reference)
        successes += verdict.outcome == Outcome.SUCCESS
        infra += verdict.outcome == Outcome.INFRA_FAILURE
        lengths += tokens
    return {
        "accuracy": successes / max(len(prompts), 1),
        "prompts": len(prompts),
        "infra_failures": infra,
        "mean_tokens": lengths / max(len(prompts), 1),
    }


def scoring_verifier(verify: VerifyConfig) -> Verifier:
    """The verifier ``verify`` names, configured by it (RoundConfig.verify_resolved names it)."""
    if verify.verifier is None:
        raise ValueError("evaluation needs verify.verifier set; pass RoundConfig.verify_resolved")
    return get_verifier(verify.verifier, verify)


def evaluate_checkpoint(
    local_dir: str,
    prompts,
    verify: VerifyConfig,
    config: EvaluateConfig,
    train_dtype: str = "float32",
    policy_version: int | None = None,
    role: str = "rollout",
) -> Stats:
    """Score a local checkpoint on the serving engine/dtype and, if different, the training precision.

    With ``policy_version`` the live serving engine of that kind and dtype is used (weights loaded in
    place if it serves another checkpoint): a vLLM engine is started once per campaign, not per round.
    ``role``: which live engine (tasks/engines.py; overlap mode evaluates on its own).
    Without it, a fresh engine is made and released after scoring.
    """
    verifier = scoring_verifier(verify)
    if policy_version is None:
        engine, tokenizer = make_engine(config.serving_engine, local_dir, config.serving_dtype, policy_version=0)
    else:
        engine, tokenizer, _ = serving_engine(
            config.serving_engine, local_dir, config.serving_dtype, policy_version, role=role
        )
    try:
        serving = accuracy(engine, tokenizer, prompts, verifier, config.max_tokens)
    finally:
        if policy_version is None:
            close_engine(engine)
    out: Stats = {
        "eval/accuracy": serving["accuracy"],
        "eval/prompts": serving["prompts"],
        "eval/infra_failures": serving["infra_failures"],
        "eval/mean_tokens": serving["mean_tokens"],
        "eval/engine": engine.info.name,
        "eval/dtype": engine.info.dtype,
    }
    if (config.serving_engine, config.serving_dtype) != ("embedded", train_dtype):
        train_engine, _ = make_engine("embedded", local_dir, train_dtype, policy_version=0)
        at_train = accuracy(train_engine, tokenizer, prompts, verifier, config.max_tokens)["accuracy"]
        out["eval/accuracy_train_precision"] = at_train
        out["eval/serving_gap"] = serving["accuracy"] - at_train
    else:
        out["eval/accuracy_train_precision"] = serving["accuracy"]
        out["eval/serving_gap"] = 0.0
    return out


def evaluation_tags(result: dict) -> dict[str, float | str]:
    """The eval.* tags a registered model version carries (read back by `rlrounds lineage`)."""
    return {
        "eval.accuracy": result["eval/accuracy"],
        "eval.accuracy_train_precision": result["eval/accuracy_train_precision"],
        "eval.serving_gap": result["eval/serving_gap"],
        "eval.engine": result["eval/engine"],
        "eval.dtype": result["eval/dtype"],
        "eval.prompts": result["eval/prompts"],
    }


PROMOTED_TAG = "eval.promoted"  # written last: a version carrying it has been evaluated and gated
GATE_TAG = "eval.gate_passed"  # its accuracy was not below the champion's (promoted unless approval is required)


def recorded_evaluation(tags: dict[str, str]) -> dict[str, float | str]:
    """The stage's result, read back from a version's tags (a resumed round does not evaluate twice)."""
    text = {"eval/engine": tags.get("eval.engine", "?"), "eval/dtype": tags.get("eval.dtype", "?")}
    numbers = (
        "accuracy",
        "accuracy_train_precision",
        "serving_gap",
        "prompts",
        "infra_failures",
        "mean_tokens",
        "promoted",
        "gate_passed",
    )
    return {**{f"eval/{k}": float(tags[f"eval.{k}"]) for k in numbers if f"eval.{k}" in tags}, **text}


# -- the stage ------------------------------------------------------------------------------------


def run_evaluate(
    *,
    ctx: RoundContext,
    config: EvaluateConfig,
    prompts: PromptsConfig,
    verify: VerifyConfig,
    checkpoint: str,
    model_version: str | None,
    train_dtype: str = "float32",
    engine_role: Annotated[str, NotInput("which live engine scores; greedy scores are the same on either")] = "rollout",
) -> Evaluation:
    """Score the checkpoint, record it on the round's run and the model version, apply the champion gate.

    Idempotent: a version already carrying ``eval.promoted`` returns its recorded evaluation; a crash
    before that tag re-runs the (greedy, deterministic) evaluation and reaches the same gate decision."""
    root = StorageRoot.of(ctx.storage)
    tracker = Tracker.connect(settings(), root)
    recorded: dict[str, str] = {}
    if model_version:
        recorded = tracker.model_version(*parse_model_version(model_version)).tags
        if PROMOTED_TAG in recorded:
            return Evaluation(stats=recorded_evaluation(recorded))
    local = checkpoints.local_copy(root, checkpoint)
    held_out = evaluation_prompts(prompts, config.source)
    result = evaluate_checkpoint(
        local, held_out, verify, config, train_dtype, policy_version=ctx.round, role=engine_role
    )
    promoted = passed = False
    if model_version:
        name, version = parse_model_version(model_version)
        tracker.tag_model_version(
            name,
            version,
            {
                **evaluation_tags(result),
                **precision_tags(result),
                "eval.infra_failures": result["eval/infra_failures"],
                "eval.mean_tokens": result["eval/mean_tokens"],
            },
        )
        # Read, compare and move the alias as one step: two campaigns of one line finishing together
        # would otherwise each compare with the old champion and the later write would win.
        with lease(root, root.join("locks", f"champion-{name}-{config.champion_alias}.lock")):
            champion = tracker.alias_version(name, config.champion_alias)
            best = -1.0
            if champion and champion != version:
                champion_tags = tracker.model_version(name, champion).tags
                check_same_line(name, config.champion_alias, champion, champion_tags, recorded)
                best = champion_accuracy(tracker, root, name, champion, result, held_out, verify, config, train_dtype)
            passed = result["eval/accuracy"] >= best
            if passed and config.approval == "none":  # 'required': a person decides (tasks/approval.py)
                tracker.set_alias(name, config.champion_alias, version)
                promoted = True
            if best >= 0:
                result = {**result, "eval/champion_accuracy": best}
            tracker.tag_model_version(name, version, {PROMOTED_TAG: float(promoted), GATE_TAG: float(passed)})
        describe_version(tracker, root, model_version)  # the MLflow UI's summary of the tags just written
    return Evaluation(stats={**result, "eval/promoted": float(promoted), "eval/gate_passed": float(passed)})


def other_line(champion_tags: dict[str, str], candidate_tags: dict[str, str]) -> str | None:
    """The champion's line when it differs from the candidate's, else None. A version registered before
    lines were recorded has none and is taken to be of the candidate's line (there is nothing to tell)."""
    theirs, ours = champion_tags.get(LINE_TAG), candidate_tags.get(LINE_TAG)
    return theirs if theirs and ours and theirs != ours else None


def check_same_line(name: str, alias: str, champion: str, champion_tags: dict, candidate_tags: dict) -> None:
    """Refuse to gate a checkpoint against a champion of another line: their accuracies were measured on
    other tasks or held-out sets, so comparing them would move the alias on a meaningless difference."""
    theirs = other_line(champion_tags, candidate_tags)
    if theirs is not None:
        ours = candidate_tags[LINE_TAG]
        raise LineageError(
            f"the {alias} of {name} is version {champion}, of promotion line {theirs!r}, but this checkpoint is of "
            f"line {ours!r}: a gate compares only checkpoints of one task and held-out set; leave "
            f"publish.model_name unset (each line gets its own registered model, rlrounds-{ours}) or give this "
            "line a model name of its own"
        )


def champion_accuracy(
    tracker,
    root,
    name: str,
    champion: str,
    result: Stats,
    prompts,
    verify: VerifyConfig,
    config: EvaluateConfig,
    train_dtype: str,
) -> float:
    """The champion's serving accuracy on the engine and dtype ``result`` was measured with.

    A figure from another engine or dtype is not comparable (bfloat16 greedy answers differ from
    float32 ones), so a champion without one is scored now, on a fresh engine, and tagged."""
    key = f"eval.{result['eval/engine']}.{result['eval/dtype']}.accuracy"
    registered = tracker.model_version(name, champion)
    if key in registered.tags:
        return float(registered.tags[key])
    tags = registered.tags
    same_place = (tags.get("eval.engine"), tags.get("eval.dtype")) == (result["eval/engine"], result["eval/dtype"])
    if same_place and "eval.accuracy" in tags:
        return float(tags["eval.accuracy"])
    local = checkpoints.local_copy(root, checkpoint_uri(registered))
    scored = evaluate_checkpoint(local, prompts, verify, config, train_dtype, policy_version=None)
    tracker.tag_model_version(name, champion, precision_tags(scored))
    return float(scored["eval/accuracy"])


def precision_tags(result: dict) -> dict[str, float | str]:
    """Tags keyed by engine and dtype (``eval.vllm.bfloat16.accuracy``), so evaluations of one model
    version at several serving precisions sit side by side instead of overwriting each other."""
    where = f"eval.{result['eval/engine']}.{result['eval/dtype']}"
    return {
        f"{where}.accuracy": result["eval/accuracy"],
        f"{where}.accuracy_train_precision": result["eval/accuracy_train_precision"],
        f"{where}.serving_gap": result["eval/serving_gap"],
        f"{where}.prompts": result["eval/prompts"],
    }


def run_evaluate_version(
    *,
    storage: str,
    model_version: str,
    config: EvaluateConfig,
    prompts: PromptsConfig,
    verify: VerifyConfig,
    train_dtype: str = "float32",
) -> VersionEvaluation:
    """Score a registered model version ('NAME/VERSION') at ``config``'s serving engine and dtype and at
    training precision; tag both and the gap on the version. The champion alias is not touched."""
    name, version = parse_model_version(model_version)
    root = StorageRoot.of(storage)
    tracker = Tracker.connect(settings(), root)
    registered = tracker.registered_version(name, version, where=f" in {storage}")
    local = checkpoints.local_copy(root, checkpoint_uri(registered))
    held_out = evaluation_prompts(prompts, config.source)
    round_tag = str(registered.tags.get("round", ""))
    # With its policy version known, the version is scored on the live serving engine when this
    # process has one of that kind and dtype (weights swapped in place) instead of starting another.
    result = evaluate_checkpoint(
        local, held_out, verify, config, train_dtype, policy_version=int(round_tag) if round_tag.isdigit() else None
    )
    tags = precision_tags(result)
    if "eval.accuracy" not in registered.tags:  # never evaluated: this becomes its evaluation
        tags.update(evaluation_tags(result))
    tracker.tag_model_version(name, version, tags)
    return VersionEvaluation(
        model_version=model_version, checkpoint=checkpoint_uri(registered), train_dtype=train_dtype, stats=result
    )
