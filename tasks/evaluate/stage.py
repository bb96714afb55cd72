"""Evaluation: greedy held-out accuracy, at the precision and engine the policy will be served with.

Evaluating only at training precision hides the engine/trainer numeric gap; so every checkpoint is
scored on the serving engine and dtype (by default the embedded engine at bfloat16, the precision a
policy is usually served at), and on the training precision too when they differ, and the gap is
logged. Accuracy is successes over every held-out prompt: a prompt the verifier could not score
(infra_failure) is not a success, so a flaky environment can only lower it, never inflate it.

The round's evaluate stage (``run_evaluate``) scores its checkpoint here and hands the scores to the
champion gate (tasks/evaluate/gate.py), which decides whether the checkpoint takes the champion alias. The embedded
engine scores on the round's ``device``; greedy answers there may differ from the CPU's in a near tie, as
they may between dtypes, so like the dtype the device is what the policy is served on. Replays
and ``rlrounds eval`` (``run_evaluate_version``) score without the gate, so never move the alias.
"""

from __future__ import annotations

from typing import Annotated

from transformers import PreTrainedTokenizerBase

from models.checkpoint import context_length
from models.engines.greedy import greedy_completions
from models.engines.sessions import open_session
from models.engines.types import RolloutEngine, SamplingParams
from storage import checkpoints
from storage.model_versions import parse_model_version
from storage.paths import StorageRoot
from storage.settings import settings
from storage.tracking import Tracker, checkpoint_uri
from tasks.config.base import AddedInput, NotInput
from tasks.config.environment import EpisodeConfig
from tasks.config.evaluate import EvaluateConfig
from tasks.config.prompts import PromptsConfig
from tasks.config.verify import VerifyConfig
from tasks.environments.runner import EpisodeRunner
from tasks.environments.tool_pool import ToolPool
from tasks.environments.tools import Tool
from tasks.environments.types import load_environment
from tasks.evaluate.gate import PROMOTED_TAG, champion_gate, recorded_verdict
from tasks.prompts.sources import evaluation_prompts
from tasks.publish.describe import describe_version
from tasks.round.context import RoundContext
from tasks.round.results import Evaluation, HeldOutScores, VersionEvaluation
from tasks.serving.engines import make_engine
from tasks.serving.live import LiveEngines
from tasks.verifiers.outcome import Outcome, Verifier
from tasks.verifiers.pool import run_verifier
from tasks.verifiers.registry import get_verifier


def accuracy(
    engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, prompts, verifier: Verifier, max_tokens: int
) -> dict[str, float]:
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


def episode_accuracy(
    engine: RolloutEngine,
    tokenizer,
    prompts,
    environment: str,
    episode: EpisodeConfig,
    max_tokens: int,
    max_context: int | None = None,
) -> dict[str, float]:
    """Greedy held-out success of ``engine`` as an agent: one episode per prompt in ``environment`` (within
    ``episode``'s budgets, ``max_tokens`` per turn); the same figures as ``accuracy``. An episode that ends in an
    environment failure is not a success (and is reported), as an unscored single-turn answer is not."""
    factory = load_environment(environment)
    tools = [Tool.from_function(f) for f in getattr(factory, "tool_functions", ())]
    with ToolPool(tools, episode.tools) as pool:
        runner = EpisodeRunner(
            open_session(engine, max_live=max(1, len(prompts))),
            tokenizer,
            factory,
            pool,
            budget=episode.budget,
            sampling=SamplingParams(0.0, 1.0, max_tokens, 0),
            env_workers=episode.env_workers,
            max_context=max_context,
        )
        records, _ = runner.run(prompts, group_id=lambda index, prompt: f"eval-{index:06d}")
    successes = sum(r.outcome == Outcome.SUCCESS for r in records)
    return {
        "accuracy": successes / max(len(prompts), 1),
        "prompts": len(prompts),
        "infra_failures": sum(r.outcome == Outcome.INFRA_FAILURE for r in records),
        "mean_tokens": sum(len(r.token_ids) for r in records) / max(len(prompts), 1),
    }


def held_out_scorer(
    verify: VerifyConfig, environment: str | None, episode: EpisodeConfig | None, max_context: int | None = None
):
    """``score(engine, tokenizer, prompts, max_tokens) -> figures``: ``accuracy`` with the verifier ``verify`` names,
    or with ``environment`` set, ``episode_accuracy`` in it."""
    if environment is not None:
        return lambda engine, tokenizer, prompts, max_tokens: episode_accuracy(
            engine, tokenizer, prompts, environment, episode or EpisodeConfig(), max_tokens, max_context
        )
    verifier = scoring_verifier(verify)
    return lambda engine, tokenizer, prompts, max_tokens: accuracy(engine, tokenizer, prompts, verifier, max_tokens)


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
    *,
    train_dtype: str = "float32",
    engines: LiveEngines | None = None,
    policy_version: int | None = None,
    role: str = "rollout",
    device: str = "auto",
    environment: str | None = None,
    episode: EpisodeConfig | None = None,
) -> HeldOutScores:
    """Score a local checkpoint on the serving engine/dtype and, if different, the training precision.

    With ``engines`` and ``policy_version`` the live serving engine of that kind and dtype is used (weights loaded
    in place if it serves another checkpoint): a vLLM engine is started once per campaign, not per round.
    ``role``: which live engine (tasks/serving/live.py; overlap mode evaluates on its own).
    Without them, a fresh engine is made and released after scoring. ``device``: where embedded engines score.
    ``environment``: score as an agent, one greedy episode per prompt in it (``episode_accuracy``).
    """
    score = held_out_scorer(verify, environment, episode, context_length(local_dir))
    live = engines is not None and policy_version is not None
    if live:
        engine, tokenizer, _ = engines.serve(
            config.serving_engine,
            local_dir,
            dtype=config.serving_dtype,
            policy_version=policy_version,
            role=role,
            device=device,
        )
    else:
        engine, tokenizer = make_engine(
            config.serving_engine, local_dir, dtype=config.serving_dtype, policy_version=0, device=device
        )
    try:
        serving = score(engine, tokenizer, prompts, config.max_tokens)
    finally:
        if not live:
            engine.close()
    if (config.serving_engine, config.serving_dtype) != ("embedded", train_dtype):
        train_engine, _ = make_engine("embedded", local_dir, dtype=train_dtype, policy_version=0, device=device)
        at_train = score(train_engine, tokenizer, prompts, config.max_tokens)["accuracy"]
    else:
        at_train = serving["accuracy"]
    return HeldOutScores(
        accuracy=serving["accuracy"],
        prompts=serving["prompts"],
        infra_failures=serving["infra_failures"],
        mean_tokens=serving["mean_tokens"],
        engine=engine.info.name,
        dtype=engine.info.dtype,
        accuracy_train_precision=at_train,
        serving_gap=serving["accuracy"] - at_train,
    )


def evaluation_tags(scores: HeldOutScores) -> dict[str, float | str]:
    """The eval.* tags a registered model version carries (read back by `rlrounds lineage`)."""
    return {
        "eval.accuracy": scores.accuracy,
        "eval.accuracy_train_precision": scores.accuracy_train_precision,
        "eval.serving_gap": scores.serving_gap,
        "eval.engine": scores.engine,
        "eval.dtype": scores.dtype,
        "eval.prompts": scores.prompts,
    }


def precision_tags(scores: HeldOutScores) -> dict[str, float | str]:
    """Tags keyed by engine and dtype (``eval.vllm.bfloat16.accuracy``), so evaluations of one model
    version at several serving precisions sit side by side instead of overwriting each other."""
    where = f"eval.{scores.engine}.{scores.dtype}"
    return {
        f"{where}.accuracy": scores.accuracy,
        f"{where}.accuracy_train_precision": scores.accuracy_train_precision,
        f"{where}.serving_gap": scores.serving_gap,
        f"{where}.prompts": scores.prompts,
    }


def recorded_scores(tags: dict[str, str]) -> HeldOutScores:
    """A round's scores read back from the eval.* tags ``run_evaluate`` wrote on its model version."""
    text = ("engine", "dtype")
    return HeldOutScores(
        **{
            name: tags.get(f"eval.{name}", "?") if name in text else float(tags[f"eval.{name}"])
            for name in HeldOutScores.model_fields
        }
    )


def recorded_evaluation(tags: dict[str, str]) -> Evaluation:
    """The stage's result, read back from a version's tags (a resumed round does not evaluate twice)."""
    return Evaluation(**recorded_scores(tags).model_dump(), **recorded_verdict(tags))


# -- the stage ------------------------------------------------------------------------------------


def run_evaluate(
    *,
    ctx: RoundContext,
    config: EvaluateConfig,
    prompts: PromptsConfig,
    verify: VerifyConfig,
    environment: Annotated[str | None, AddedInput(since="2026-12-04", keyed_at_default=False)] = None,
    episode: Annotated[EpisodeConfig | None, AddedInput(since="2026-12-04", keyed_at_default=False)] = None,
    checkpoint: str,
    model_version: str | None,
    train_dtype: str = "float32",
    engines: Annotated[LiveEngines, NotInput("the live engines of the flow that runs the round")],
    engine_role: Annotated[str, NotInput("which live engine scores; greedy scores are the same on either")] = "rollout",
    device: Annotated[
        str, NotInput("where it computes: a round resumed on another machine is not scored again")
    ] = "auto",
) -> Evaluation:
    """Score the checkpoint, record it on the model version, apply the champion gate (tasks/evaluate/gate.py).

    Idempotent: a version already carrying ``eval.promoted`` returns its recorded evaluation; a crash
    before that tag re-runs the (greedy, deterministic) evaluation and reaches the same gate decision."""
    root = StorageRoot.of(ctx.storage)
    tracker = Tracker.connect(settings(), root)
    recorded: dict[str, str] = {}
    if model_version:
        recorded = tracker.model_version(*parse_model_version(model_version)).tags
        if PROMOTED_TAG in recorded:
            return recorded_evaluation(recorded)
    local = checkpoints.local_copy(root, checkpoint)
    held_out = evaluation_prompts(prompts, config.source)
    scores = evaluate_checkpoint(
        local,
        held_out,
        verify,
        config,
        train_dtype=train_dtype,
        engines=engines,
        policy_version=ctx.round,
        role=engine_role,
        device=device,
        environment=environment,
        episode=episode,
    )
    if not model_version:  # nothing registered, nothing to promote
        return Evaluation(**scores.model_dump(), promoted=False, gate_passed=False)
    name, version = parse_model_version(model_version)
    tracker.tag_model_version(
        name,
        version,
        {
            **evaluation_tags(scores),
            **precision_tags(scores),
            "eval.infra_failures": scores.infra_failures,
            "eval.mean_tokens": scores.mean_tokens,
        },
    )
    evaluation = champion_gate(
        tracker,
        root,
        model_version,
        scores,
        recorded,
        alias=config.champion_alias,
        approval_required=config.approval == "required",  # then a person decides (tasks/evaluate/approval.py)
        champion_accuracy=lambda champion: champion_accuracy(
            tracker,
            root,
            name,
            champion,
            scores=scores,
            prompts=held_out,
            verify=verify,
            config=config,
            train_dtype=train_dtype,
            device=device,
            environment=environment,
            episode=episode,
        ),
    )
    describe_version(tracker, root, model_version)  # the MLflow UI's summary of the tags just written
    return evaluation


def champion_accuracy(
    tracker,
    root,
    name: str,
    champion: str,
    *,
    scores: HeldOutScores,
    prompts,
    verify: VerifyConfig,
    config: EvaluateConfig,
    train_dtype: str,
    device: str = "auto",
    environment: str | None = None,
    episode: EpisodeConfig | None = None,
) -> float:
    """The champion's serving accuracy on the engine and dtype ``scores`` were measured with.

    A figure from another engine or dtype is not comparable (bfloat16 greedy answers differ from
    float32 ones), so a champion without one is scored now, on a fresh engine, and tagged."""

    key = f"eval.{scores.engine}.{scores.dtype}.accuracy"
    registered = tracker.model_version(name, champion)
    if key in registered.tags:
        return float(registered.tags[key])
    tags = registered.tags
    same_place = (tags.get("eval.engine"), tags.get("eval.dtype")) == (scores.engine, scores.dtype)
    if same_place and "eval.accuracy" in tags:
        return float(tags["eval.accuracy"])
    local = checkpoints.local_copy(root, checkpoint_uri(registered))
    scored = evaluate_checkpoint(
        local, prompts, verify, config, train_dtype=train_dtype, device=device, environment=environment, episode=episode
    )
    tracker.tag_model_version(name, champion, precision_tags(scored))
    return scored.accuracy


def run_evaluate_version(
    *,
    storage: str,
    model_version: str,
    config: EvaluateConfig,
    prompts: PromptsConfig,
    verify: VerifyConfig,
    train_dtype: str = "float32",
    engines: Annotated[LiveEngines, NotInput("the live engines of the flow that scores")],
    device: str = "auto",
    environment: str | None = None,
    episode: EpisodeConfig | None = None,
) -> VersionEvaluation:
    """Score a registered model version ('NAME/VERSION') at ``config``'s serving engine and dtype and at
    training precision, on ``device``; tag both and the gap on the version. The champion alias is not touched."""
    name, version = parse_model_version(model_version)
    root = StorageRoot.of(storage)
    tracker = Tracker.connect(settings(), root)
    registered = tracker.registered_version(name, version, where=f" in {storage}")
    local = checkpoints.local_copy(root, checkpoint_uri(registered))
    held_out = evaluation_prompts(prompts, config.source)
    round_tag = str(registered.tags.get("round", ""))
    # With its policy version known, the version is scored on the live serving engine when the calling
    # flow has one of that kind and dtype (weights swapped in place) instead of starting another.
    policy_version = int(round_tag) if round_tag.isdigit() else None
    scores = evaluate_checkpoint(
        local,
        held_out,
        verify,
        config,
        train_dtype=train_dtype,
        engines=engines,
        policy_version=policy_version,
        device=device,
        environment=environment,
        episode=episode,
    )
    tags = precision_tags(scores)
    if "eval.accuracy" not in registered.tags:  # never evaluated: this becomes its evaluation
        tags.update(evaluation_tags(scores))
    tracker.tag_model_version(name, version, tags)
    return VersionEvaluation(
        **scores.model_dump(),
        model_version=model_version,
        checkpoint=checkpoint_uri(registered),
        train_dtype=train_dtype,
    )
