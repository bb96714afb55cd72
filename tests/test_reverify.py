"""Re-verification: a round whose environment failed on some samples is scored again once it is fixed,
into a derived version that records the new verdicts, the verifier version and its parent, and that
training can replay."""

import hashlib
import threading
from collections import Counter

import pytest

from tasks.verifiers.outcome import Outcome, Verdict, VerifierInfraError


def _reward(completion, reference):
    h = int(hashlib.sha256(f"{completion}|{reference}".encode()).hexdigest(), 16)
    return h, (Verdict(1.0, Outcome.SUCCESS) if h % 3 == 0 else Verdict(0.0, Outcome.MODEL_FAILURE))


class Environment:
    """A coin reward; while ``broken``, a fifth of the samples can never be verified (no sandbox starts)."""

    def __init__(self):
        self.broken = True
        self.calls = Counter()
        self.lock = threading.Lock()

    def __call__(self, completion, reference):
        h, verdict = _reward(completion, reference)
        with self.lock:
            self.calls[self.broken] += 1
        if self.broken and h % 5 == 0:
            raise VerifierInfraError("sandbox could not start: no free uid")
        return verdict


@pytest.fixture
def faulty_round(tmp_path, tiny_policy_dir, monkeypatch):
    from flows.config import RoundConfig
    from flows.resources import CampaignResources
    from tasks.config.verify import KNOWN_VERIFIERS
    from tasks.filter.stage import run_filter
    from tasks.rollout.stage import run_rollout
    from tasks.round.context import RoundContext
    from tasks.verifiers import registry
    from tasks.verifiers.registry import VerifierSpec

    environment = Environment()
    monkeypatch.setitem(registry.VERIFIERS, "flaky-env", VerifierSpec("1", lambda _config: environment))
    monkeypatch.setitem(KNOWN_VERIFIERS, "flaky-env", "test")
    resources = CampaignResources()
    config = RoundConfig.model_validate(
        {
            "verify": {"verifier": "flaky-env", "infra_retries": 1, "max_infra_failure_rate": 0.5},
            "rollout": {"samples_per_prompt": 4, "max_tokens": 3},
            "train": {"groups_per_step": 4, "steps_per_round": 2},
        }
    )
    ctx = RoundContext(
        storage=str(tmp_path / "data"),
        run_id="flaky",
        round=1,
        experiment="t",
        parent_checkpoint=tiny_policy_dir,
        parent_policy_version=0,
        parent_model_version="none",
        base_model="tiny",
        config_hash="h",
        code_version="test",
        flow_run_id="none",
        mlflow_run_id="none",
        seed=3,
    )
    rollout = run_rollout(
        ctx=ctx,
        prompts=config.prompts,
        rollout=config.rollout,
        verify=config.verify_resolved,
        filtering=config.filter,
        target_groups=config.target_groups,
        engines=resources.engines,
    )
    trajectories = run_filter(
        ctx=ctx,
        staging=rollout.staging,
        config=config.filter,
        target_groups=config.target_groups,
        rollout_stats=rollout.stats,
    )
    with resources:
        yield {
            "ctx": ctx,
            "config": config,
            "version": trajectories.version,
            "environment": environment,
            "resources": resources,
        }


def _rows(storage, version):
    from storage.paths import StorageRoot
    from storage.trajectories import find_version, read_table

    root = StorageRoot.of(storage)
    manifest = find_version(root, version)
    return manifest, {(r["group_id"], r["sample_index"]): r for r in read_table(root, manifest).to_pylist()}


def test_reverify_scores_infra_failures_again_into_a_replayable_derived_version(faulty_round, capsys, monkeypatch):
    from flows.cli import main
    from tasks.train.stage import run_train
    from tasks.verifiers import registry
    from tasks.verifiers.registry import VerifierSpec

    ctx, storage = faulty_round["ctx"], faulty_round["ctx"].storage
    _, before = _rows(storage, faulty_round["version"])
    infra = {k for k, r in before.items() if r["outcome"] == "infra_failure"}
    assert infra and all(not before[k]["kept"] for k in infra)
    environment = faulty_round["environment"]
    environment.broken = False  # the environment is fixed, and the verifier's version says so
    monkeypatch.setitem(registry.VERIFIERS, "flaky-env", VerifierSpec("2", lambda _config: environment))
    assert main(["reverify", faulty_round["version"][:10], "--storage", storage]) == 0
    printed = capsys.readouterr().out
    assert f"{len(infra)} rows verified again with flaky-env v2" in printed and "infra_failure" in printed
    derived_version = printed.split()[2]
    manifest, after = _rows(storage, derived_version)
    # every row is there; exactly the failed ones were scored again, by the fixed verifier
    assert after.keys() == before.keys()
    assert manifest.parent == faulty_round["version"] and manifest.kind == "derived"
    assert manifest.derivation["reverify"]["verifier"] == {"name": "flaky-env", "version": "2"}
    assert manifest.derivation["reverify"]["outcomes_before"] == {"infra_failure": len(infra)}
    touched = {g for g, _ in infra}
    for key, row in after.items():
        if key in infra:
            expected = _reward(row["completion_text"], row["reference"])[1]
            assert row["outcome"] == expected.outcome.value and row["reward"] == expected.reward
            assert row["verifier"] == {"name": "flaky-env", "version": "2"} and row["verify_error"] is None
        else:  # not verified again; a group holding a re-verified row is judged again, others are as stored
            judged = {"trajectory_version"} | ({"advantage", "kept", "drop_reason"} if key[0] in touched else set())
            unchanged = {k: v for k, v in before[key].items() if k not in judged}
            assert {k: v for k, v in row.items() if k not in judged} == unchanged
    assert any(after[k]["kept"] for k in after if k[0] in touched)  # groups regained signal
    # replay can train on it: the same parent, the derived rows
    trained = run_train(
        ctx=ctx,
        trajectory_uri=manifest.directory,
        config=faulty_round["config"].train,
        temperature=1.0,
        rollout_dtype="float32",
        target_checkpoint=str(ctx.storage) + "/reverified-checkpoint",
        engines=faulty_round["resources"].engines,
        trainers=faulty_round["resources"].trainers,
    )
    train = faulty_round["config"].train
    assert trained.stats["train/samples"] > 0 and trained.stats["train/steps"] == 2 * train.epochs
    assert sum(r["kept"] for r in after.values()) > sum(r["kept"] for r in before.values())


def test_reverify_with_a_predicate_and_a_bad_one(faulty_round, capsys):
    from flows.cli import main

    storage, version = faulty_round["ctx"].storage, faulty_round["version"]
    faulty_round["environment"].broken = False
    assert main(["reverify", version, "--where", "sample_index = 0", "--storage", storage]) == 0
    _, before = _rows(storage, version)
    assert f"{sum(k[1] == 0 for k in before)} rows verified again" in capsys.readouterr().out
    assert main(["reverify", version, "--where", "no_such_column = 1", "--storage", storage]) != 0
    assert "invalid --where predicate" in capsys.readouterr().err


@pytest.mark.slow  # starts a Prefect server
def test_the_reverify_flow_takes_a_pydantic_request(faulty_round, prefect_harness):
    from flows.replay import rl_reverify
    from tasks.config.refilter import ReverifyRequest

    faulty_round["environment"].broken = False
    request = ReverifyRequest(version=faulty_round["version"])
    result = rl_reverify(request, storage=faulty_round["ctx"].storage)  # the flow behind the `reverify` deployment
    assert result.parent == faulty_round["version"] and result.verifier["name"] == "flaky-env"
    assert result.rows > 0 and "infra_failure" not in result.outcomes_after
