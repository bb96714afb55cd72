"""The champion gate, on a real MLflow registry (SQLite) and real evaluations of a tiny policy.

The verifier is the knob: each test decides what the held-out answers are worth, so a checkpoint is
"better" or "worse" by construction, and the gate's decision is the only thing under test."""

import hashlib

import pytest

from tasks.config.evaluate import EvaluateConfig
from tasks.config.prompts import PromptsConfig
from tasks.config.verify import VerifyConfig
from tasks.verifiers.outcome import Outcome, Verdict, VerifierInfraError

NAME = "gate-policy"
JUDGE = VerifyConfig(verifier="judge")


def _even(reference: str) -> bool:
    return int(hashlib.sha256(reference.encode()).hexdigest(), 16) % 2 == 0


class Judge:
    """right: every answer succeeds; wrong: none does; half: the prompts with an even reference hash
    succeed (whatever the model says); flaky: those succeed and the others cannot be scored."""

    mode = "right"

    def __call__(self, completion, reference):
        if self.mode == "right" or (self.mode in ("half", "flaky") and _even(reference)):
            return Verdict(1.0, Outcome.SUCCESS)
        if self.mode == "flaky":
            raise VerifierInfraError("sandbox could not start")
        return Verdict(0.0, Outcome.MODEL_FAILURE)


@pytest.fixture
def registry(tmp_path, tiny_policy_dir, monkeypatch):
    """A storage root with an MLflow registry, a round run, and a function registering round k's
    checkpoint (the tiny policy) as a model version."""
    from storage.paths import StorageRoot
    from storage.settings import settings
    from storage.tracking import Tracker
    from tasks.config.verify import KNOWN_VERIFIERS
    from tasks.publish.stage import lineage_tags
    from tasks.serving.live import LiveEngines
    from tasks.verifiers import registry as verifiers
    from tasks.verifiers.registry import VerifierSpec

    judge = Judge()
    monkeypatch.setitem(verifiers.VERIFIERS, "judge", VerifierSpec("test", lambda _config: judge))
    monkeypatch.setitem(KNOWN_VERIFIERS, "judge", "test")
    storage = str(tmp_path / "data")
    tracker = Tracker.connect(settings(), StorageRoot.of(storage))
    run = tracker.ensure_run(tracker.experiment_id("gate"), "gate", {"rlrounds.test": "gate"})

    def register(k: int, line: str = "addition") -> str:
        tags = lineage_tags(_round_context(storage, run, k), trajectory_version="none", line=line)
        return f"{NAME}/{tracker.register(NAME, tiny_policy_dir, run, tags)}"

    with LiveEngines() as engines:
        yield {
            "storage": storage,
            "tracker": tracker,
            "run": run,
            "register": register,
            "judge": judge,
            "engines": engines,
        }


def _round_context(storage: str, run: str, k: int):
    """Round k of the campaign 'gate' (its parent registered nowhere)."""
    from tasks.round.context import RoundContext

    return RoundContext(
        storage=storage,
        run_id="gate",
        round=k,
        experiment="gate",
        parent_checkpoint="unused",
        parent_policy_version=k - 1,
        parent_model_version="none",
        base_model="tiny",
        config_hash="h",
        code_version="test",
        flow_run_id="none",
        mlflow_run_id=run,
        seed=0,
    )


def _evaluate(registry, k: int, mode: str, model_version: str, config: EvaluateConfig | None = None) -> dict:
    from tasks.evaluate.stage import run_evaluate

    registry["judge"].mode = mode
    ctx = _round_context(registry["storage"], registry["run"], k)
    checkpoint = registry["tracker"].model_version(*model_version.split("/")).source
    return run_evaluate(
        ctx=ctx,
        config=config or EvaluateConfig(),
        prompts=PromptsConfig(),
        verify=JUDGE,
        checkpoint=checkpoint,
        model_version=model_version,
        engines=registry["engines"],
    ).metrics()


def _champion(registry) -> str:
    return f"{NAME}/{registry['tracker'].alias_version(NAME, 'champion')}"


def test_a_worse_checkpoint_does_not_take_the_alias_and_an_equal_one_does(registry):
    v1, v2, v3 = (registry["register"](k) for k in (0, 1, 2))
    assert _evaluate(registry, 0, "half", v1)["eval/promoted"] == 1.0  # the first evaluated version
    worse = _evaluate(registry, 1, "wrong", v2)
    assert worse["eval/accuracy"] == 0.0 and worse["eval/promoted"] == 0.0
    assert _champion(registry) == v1
    assert _evaluate(registry, 2, "half", v3)["eval/promoted"] == 1.0  # not below the champion
    assert _champion(registry) == v3


def test_infra_failures_during_evaluation_count_against_promotion(registry):
    v1, v2 = registry["register"](0), registry["register"](1)
    assert _evaluate(registry, 0, "right", v1)["eval/accuracy"] == 1.0
    flaky = _evaluate(registry, 1, "flaky", v2)
    # every answer it could score was right; the rest could not be scored, and are not successes
    assert flaky["eval/infra_failures"] > 0
    assert flaky["eval/accuracy"] == pytest.approx(1.0 - flaky["eval/infra_failures"] / 500)
    # left out of the denominator they would read 100% and take the alias on the environment's failures
    assert flaky["eval/promoted"] == 0.0 and _champion(registry) == v1


def test_the_gate_compares_with_the_champion_at_the_same_engine_and_dtype(registry):
    v1, v2 = registry["register"](0), registry["register"](1)
    # v1 became champion on a float32 evaluation that read 100%, an engine/dtype v2 is not scored at
    _evaluate(registry, 0, "right", v1, EvaluateConfig(serving_dtype="float32"))
    assert _champion(registry) == v1
    tags = registry["tracker"].model_version(NAME, "1").tags
    assert tags["eval.dtype"] == "float32" and "eval.embedded.bfloat16.accuracy" not in tags
    candidate = _evaluate(registry, 1, "half", v2)  # the default: served at bfloat16
    assert candidate["eval/dtype"] == "bfloat16" and candidate["eval/accuracy"] < 1.0
    # the champion was scored at bfloat16 too, with the same verdicts: a tie, so the alias moves
    champion_tags = registry["tracker"].model_version(NAME, "1").tags
    assert float(champion_tags["eval.embedded.bfloat16.accuracy"]) == candidate["eval/accuracy"]
    assert candidate["eval/promoted"] == 1.0 and _champion(registry) == v2


def test_rlrounds_eval_and_replay_never_move_the_alias(registry):
    from tasks.campaign.replay import ReplayPlan, run_publish_replay
    from tasks.config.train import TrainConfig
    from tasks.evaluate.stage import run_evaluate_version
    from tasks.round.context import RoundContext

    v1, v2 = registry["register"](0), registry["register"](1)
    _evaluate(registry, 0, "half", v1)
    registry["judge"].mode = "right"  # whatever they score is better than the champion's
    scored = run_evaluate_version(
        storage=registry["storage"],
        model_version=v2,
        config=EvaluateConfig(),
        prompts=PromptsConfig(),
        verify=JUDGE,
        engines=registry["engines"],
    )
    assert scored.metrics()["eval/accuracy"] == 1.0 and _champion(registry) == v1
    ctx = RoundContext(
        storage=registry["storage"],
        run_id="replay-x",
        round=1,
        experiment="gate",
        parent_checkpoint=registry["tracker"].model_version(NAME, "1").source,
        parent_policy_version=0,
        parent_model_version=v1,
        base_model="tiny",
        config_hash="h",
        code_version="test",
        flow_run_id="none",
        mlflow_run_id=registry["run"],
        seed=0,
    )
    plan = ReplayPlan(
        replay_id="replay-x",
        context=ctx,
        trajectory_version="t" * 20,
        trajectory_uri="none",
        train=TrainConfig(),
        temperature=1.0,
        rollout_dtype="float32",
        checkpoint=ctx.parent_checkpoint,
        model_name=NAME,
        line="addition",
        source={},
    )
    replayed = run_publish_replay(
        plan=plan,
        checkpoint=ctx.parent_checkpoint,
        train_stats={},
        evaluate=EvaluateConfig(),
        prompts=PromptsConfig(),
        verify=JUDGE,
    )
    assert replayed.stats["eval/accuracy"] == 1.0
    assert _champion(registry) == v1


def test_a_champion_of_another_line_is_never_compared_with(registry):
    from storage.model_versions import LineageError

    v1, v2 = registry["register"](0, line="addition"), registry["register"](1, line="addition-heldout-1a2b3c4d")
    _evaluate(registry, 0, "wrong", v1)
    assert _champion(registry) == v1
    # v2 would win on its own held-out set, but a figure from another set says nothing about v1's
    with pytest.raises(LineageError, match=r"promotion line 'addition'.*line 'addition-heldout-1a2b3c4d'.*model_name"):
        _evaluate(registry, 1, "right", v2)
    assert _champion(registry) == v1
    v3 = registry["register"](2, line="addition")
    assert _evaluate(registry, 2, "half", v3)["eval/promoted"] == 1.0  # its own line gates as before
