"""The failure taxonomy end to end: what each verifier fault becomes, how the pool retries and survives
it, and a round with injected faults that completes with those samples out of the loss."""

import hashlib
import math
import os
import threading
import time
from collections import Counter

import pytest

from tasks.config.verify import VerifyConfig
from tasks.verifiers.outcome import Outcome, Verdict, VerifierInfraError
from tasks.verifiers.pool import InfraFailureRateError, VerifierPool, check_infra_failure_rate, run_verifier

# -- what a verifier's behaviour means ------------------------------------------------------------


def _raises(exc):
    def verifier(completion, reference):
        raise exc

    return verifier


def _returns(verdict):
    return lambda completion, reference: verdict


@pytest.mark.parametrize(
    "verifier, outcome, fragment",
    [
        (_returns(Verdict(1.0, Outcome.SUCCESS)), Outcome.SUCCESS, None),  # the model got it right
        (_returns(Verdict(0.0, Outcome.MODEL_FAILURE, "wrong")), Outcome.MODEL_FAILURE, "wrong"),  # the model's fault
        (_returns(Verdict(None, Outcome.UNKNOWN)), Outcome.UNKNOWN, None),  # ran, cannot score: never a zero
        (
            _raises(VerifierInfraError("sandbox could not start")),
            Outcome.INFRA_FAILURE,
            "could not start",
        ),  # environment
        (
            _raises(KeyError("bug")),
            Outcome.INFRA_FAILURE,
            "verifier error: KeyError",
        ),  # a verifier bug is not the model's
        (
            _returns(Verdict(math.inf, Outcome.SUCCESS)),
            Outcome.INFRA_FAILURE,
            "non-finite",
        ),  # inf would swamp advantages
        (_returns(Verdict(-math.inf, Outcome.MODEL_FAILURE)), Outcome.INFRA_FAILURE, "non-finite"),  # so would -inf
        (_returns(Verdict(math.nan, Outcome.SUCCESS)), Outcome.INFRA_FAILURE, "non-finite"),  # NaN poisons the group
    ],
)
def test_taxonomy(verifier, outcome, fragment):
    verdict = run_verifier(verifier, "1", "1")
    assert verdict.outcome == outcome
    assert (verdict.reward is None) == (outcome in (Outcome.INFRA_FAILURE, Outcome.UNKNOWN))
    if fragment:
        assert fragment in verdict.error


# -- the pool ----------------------------------------------------------------------------------------


class Flaky:
    """Fails each distinct sample's first ``failures`` attempts with a retryable infrastructure error."""

    def __init__(self, failures=1, retryable=True):
        self.failures, self.retryable = failures, retryable
        self.calls = Counter()
        self.lock = threading.Lock()

    def __call__(self, completion, reference):
        with self.lock:
            self.calls[completion] += 1
            n = self.calls[completion]
        if n <= self.failures:
            raise VerifierInfraError("math worker exited", retryable=self.retryable)
        return Verdict(1.0, Outcome.SUCCESS)


def verdicts(pool, n):
    futures = [pool.submit(str(i), "x") for i in range(n)]
    return [f.result(timeout=30) for f in futures]


@pytest.mark.parametrize("inline", [False, True], ids=["workers", "inline"])
def test_retries_recover_transient_failures(inline):
    flaky = Flaky(failures=1)
    with VerifierPool(flaky, workers=2, retries=2, retry_budget=100, inline=inline) as pool:
        out = verdicts(pool, 10)
    assert [v.outcome for v in out] == [Outcome.SUCCESS] * 10 and {v.attempts for v in out} == {2}
    assert pool.stats()["verify/infra_retries"] == 10 and pool.stats()["verify/infra_recovered"] == 10


def test_permanent_failures_are_not_retried():
    flaky = Flaky(failures=5, retryable=False)  # e.g. a reference that does not parse
    with VerifierPool(flaky, workers=2, retries=3, retry_budget=100) as pool:
        out = verdicts(pool, 4)
    assert all(v.outcome == Outcome.INFRA_FAILURE and v.attempts == 1 for v in out)
    assert pool.stats()["verify/infra_retries"] == 0


@pytest.mark.parametrize("inline", [False, True], ids=["workers", "inline"])
def test_the_round_budget_caps_retries(inline):
    with VerifierPool(Flaky(failures=99), workers=2, retries=2, retry_budget=3, inline=inline) as pool:
        out = verdicts(pool, 10)
    assert all(v.outcome == Outcome.INFRA_FAILURE for v in out)
    assert sum(v.attempts - 1 for v in out) == 3 == pool.stats()["verify/infra_retries"]
    assert any("after 2 attempts" in v.error or "after 3 attempts" in v.error for v in out)


def test_a_dead_worker_fails_its_sample_and_is_replaced():
    def dies_once(completion, reference):
        if completion == "3":
            raise SystemExit("killed")  # escapes the verifier call: the worker thread is gone
        time.sleep(0.05)  # slow enough for the pool to notice the loss while work remains
        return Verdict(1.0, Outcome.SUCCESS)

    with VerifierPool(dies_once, workers=2, retries=2, retry_budget=5) as pool:
        out = verdicts(pool, 12)
    assert out[3].outcome == Outcome.INFRA_FAILURE and "verifier worker died: SystemExit" in out[3].error
    assert all(v.outcome == Outcome.SUCCESS for i, v in enumerate(out) if i != 3)
    stats = pool.stats()
    assert (
        stats["verify/worker_deaths"] == 1 and stats["verify/workers_replaced"] == 1 and not stats["verify/pool_dead"]
    )


def test_an_inline_pool_answers_on_the_callers_thread_and_a_dying_call_is_an_infra_failure():
    callers = set()

    def verifier(completion, reference):
        callers.add(threading.get_ident())
        if completion == "3":
            raise SystemExit("killed")
        return Verdict(1.0, Outcome.SUCCESS)

    threads_before = threading.active_count()
    with VerifierPool(verifier, workers=2, inline=True) as pool:
        assert threading.active_count() == threads_before  # no worker, no monitor
        futures = [pool.submit(str(i), "x") for i in range(6)]
        assert all(f.done() for f in futures)  # resolved before submit returned
    assert callers == {threading.get_ident()}
    out = [f.result() for f in futures]
    assert out[3].outcome == Outcome.INFRA_FAILURE and "verifier call died: SystemExit" in out[3].error
    assert all(v.outcome == Outcome.SUCCESS for i, v in enumerate(out) if i != 3)
    assert pool.stats()["verify/worker_deaths"] == 1


def test_a_stop_signal_raised_inside_an_inline_verifier_stops_the_caller():
    """The SIGTERM handler runs on the main thread, where inline verifiers run: Prefect's (a flow run's) raises
    TerminationSignal there and a Ctrl-C raises KeyboardInterrupt. Neither is a verifier's failure."""
    import signal

    from prefect.exceptions import TerminationSignal

    for stop in (TerminationSignal(signal.SIGTERM), KeyboardInterrupt()):

        def verifier(completion, reference, stop=stop):
            if completion == "1":
                raise stop
            return Verdict(1.0, Outcome.SUCCESS)

        with VerifierPool(verifier, workers=2, inline=True) as pool:
            pool.submit("0", "x")
            with pytest.raises(type(stop)):
                pool.submit("1", "x")
            assert pool.stats()["verify/worker_deaths"] == 0


def test_only_instant_verifiers_score_inline_and_never_behind_a_waiting_environment():
    from tasks.config.verify import SimulatedEnvironmentConfig, VerifyConfig
    from tasks.verifiers.registry import scores_inline

    assert scores_inline("addition", VerifyConfig()) and scores_inline("longtail", VerifyConfig())
    assert not scores_inline("python", VerifyConfig()) and not scores_inline("math", VerifyConfig())
    assert not scores_inline("addition", VerifyConfig(on_ray=True))
    assert not scores_inline("addition", VerifyConfig(simulated_environment=SimulatedEnvironmentConfig()))


def test_a_call_that_never_returns_times_out():
    release = threading.Event()

    def hangs_on_zero(completion, reference):
        if completion == "0":
            release.wait(10)  # a verifier stuck in a C extension or a deadlock
        return Verdict(1.0, Outcome.SUCCESS)

    start = time.monotonic()
    with VerifierPool(hangs_on_zero, workers=1, retries=2, retry_budget=5, timeout_s=0.3) as pool:
        out = verdicts(pool, 5)
    release.set()
    assert out[0].outcome == Outcome.INFRA_FAILURE and "no verdict within 0.3s" in out[0].error
    assert all(v.outcome == Outcome.SUCCESS for v in out[1:])  # served by the replacement worker
    assert time.monotonic() - start < 5 and pool.stats()["verify/verifier_timeouts"] == 1


def test_a_dead_pool_turns_pending_samples_into_infra_failures():
    def always_dies(completion, reference):
        raise SystemExit("pool killed")

    with VerifierPool(always_dies, workers=2, retry_budget=0) as pool:
        out = verdicts(pool, 20)
        late = pool.submit("late", "x").result(timeout=5)
    assert all(v.outcome == Outcome.INFRA_FAILURE and v.reward is None for v in out)
    assert (
        sum("verifier worker died" in v.error for v in out) == 2 and sum("pool is dead" in v.error for v in out) == 18
    )
    assert late.outcome == Outcome.INFRA_FAILURE and pool.stats()["verify/pool_dead"] == 1.0


def test_infra_failure_rate_gate():
    check_infra_failure_rate({"verify/infra_failure_rate": 0.2}, 0.2, 1)  # at the limit: allowed
    with pytest.raises(InfraFailureRateError, match="raise verify.max_infra_failure_rate"):
        check_infra_failure_rate({"verify/infra_failure_rate": 0.25}, 0.2, 1)


def test_verify_config_explains_its_limits():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="infra_retries"):
        VerifyConfig(infra_retries=-1)
    assert VerifyConfig().timeout_s > 5  # above the math verifier's own deadline


# -- a round with injected faults --------------------------------------------------------------------


@pytest.fixture
def own_engines():
    """The live engines and worker group the rounds below run with, released when the test ends."""
    from flows.resources import CampaignResources

    with CampaignResources() as resources:
        yield resources


class InjectedFaults:
    """A coin keyed on (completion, reference) for the reward; the environment misbehaves on cue:
    some samples can never be verified (the sandbox never starts), some fail once and recover, one call
    kills its worker, one hangs past the pool's deadline."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls = Counter()
        self.death, self.hang = True, True

    def __call__(self, completion, reference):
        h = int(hashlib.sha256(f"{completion}|{reference}".encode()).hexdigest(), 16)
        with self.lock:
            self.calls[(completion, reference)] += 1
            first = self.calls[(completion, reference)] == 1
            die = self.death and h % 13 == 2
            hang = self.hang and h % 13 == 3
            self.death &= not die
            self.hang &= not hang
        if h % 13 == 0:
            raise VerifierInfraError("sandbox could not start: no free uid")
        if h % 13 == 1 and first:
            raise VerifierInfraError("math worker exited")
        if die:
            raise SystemExit("verifier worker killed")
        if hang:
            time.sleep(2.0)
        return Verdict(1.0, Outcome.SUCCESS) if h % 3 == 0 else Verdict(0.0, Outcome.MODEL_FAILURE)


def test_injected_faults_are_labelled_kept_out_of_the_loss_and_the_round_completes(
    tmp_path, tiny_policy_dir, monkeypatch, own_engines
):
    import pyarrow.compute as pc

    from flows.config import RoundConfig
    from storage.paths import StorageRoot
    from storage.trajectories import read_manifest, read_table
    from tasks.config.verify import KNOWN_VERIFIERS
    from tasks.filter.stage import run_filter
    from tasks.rollout.stage import run_rollout
    from tasks.round.context import RoundContext
    from tasks.train.stage import kept_rows, run_train
    from tasks.verifiers import registry
    from tasks.verifiers.registry import VerifierSpec

    faults = InjectedFaults()
    monkeypatch.setitem(registry.VERIFIERS, "faulty", VerifierSpec("test", lambda _config: faults))
    monkeypatch.setitem(KNOWN_VERIFIERS, "faulty", "test")
    config = RoundConfig.model_validate(
        {
            "verify": {
                "verifier": "faulty",
                "infra_retries": 2,
                "infra_retry_budget": 64,
                "timeout_s": 0.5,
                "max_infra_failure_rate": 0.5,
            },
            # Every sample waits for its verdict: with partial rollouts the hanging call's sample could be
            # carried over unverified (the pool stops waiting on a slow environment), and this round must
            # store each injected fault.
            "rollout": {"samples_per_prompt": 4, "max_tokens": 3, "partial_rollouts": False},
            "train": {"groups_per_step": 4, "steps_per_round": 2},
        }
    )
    ctx = RoundContext(
        storage=str(tmp_path),
        run_id="faults",
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
        engines=own_engines.engines,
    )
    trajectories = run_filter(
        ctx=ctx,
        staging=rollout.staging,
        config=config.filter,
        target_groups=config.target_groups,
        rollout_stats=rollout.stats,
    )
    trained = run_train(
        ctx=ctx,
        trajectory_uri=trajectories.uri,
        config=config.train,
        temperature=config.rollout.temperature,
        rollout_dtype=config.rollout.dtype,
        engines=own_engines.engines,
        trainers=own_engines.trainers,
    )

    stats = rollout.stats
    table = read_table(StorageRoot.of(str(tmp_path)), read_manifest(StorageRoot.of(str(tmp_path)), trajectories.uri))
    rows = table.to_pylist()
    infra = [r for r in rows if r["outcome"] == "infra_failure"]
    assert infra and stats["verify/infra_failure"] == len(infra)
    assert all(
        not r["kept"] and r["drop_reason"] == "infra_failure" and r["reward"] is None and r["verify_error"]
        for r in infra
    )
    errors = " | ".join(r["verify_error"] for r in infra)
    assert "sandbox could not start" in errors and "(after 3 attempts)" in errors  # retried, then recorded
    assert "verifier worker died" in errors and "no verdict within 0.5s" in errors
    assert (
        stats["verify/infra_recovered"] > 0
        and stats["verify/worker_deaths"] == 1
        and stats["verify/verifier_timeouts"] == 1
    )
    assert stats["verify/workers_replaced"] >= 1  # 2 unless the round ended before the pool noticed a loss
    # The loss sees exactly the kept rows, and none of them is an infrastructure failure.
    trainable = kept_rows(table)
    assert trained.stats["train/samples"] == len(trainable) == table.filter(pc.field("kept")).num_rows > 0
    kept_ids = {(r["group_id"], r["sample_index"]) for r in rows if r["kept"]}
    assert not kept_ids & {(r["group_id"], r["sample_index"]) for r in infra}
    assert trained.checkpoint.endswith("checkpoint")
    print(
        f"\ninjected faults: infra failure rate {stats['verify/infra_failure_rate']:.1%} "
        f"({len(infra)}/{len(rows)} samples), retries {stats['verify/infra_retries']:.0f}, "
        f"recovered {stats['verify/infra_recovered']:.0f}, workers replaced {stats['verify/workers_replaced']:.0f}"
    )


def test_a_round_past_the_infra_failure_limit_fails_loudly_and_stages_nothing(
    tmp_path, tiny_policy_dir, monkeypatch, own_engines
):
    from flows.config import RoundConfig
    from storage.paths import StorageRoot
    from tasks.config.verify import KNOWN_VERIFIERS
    from tasks.rollout.stage import run_rollout
    from tasks.round.context import RoundContext
    from tasks.verifiers import registry
    from tasks.verifiers.registry import VerifierSpec

    def broken(completion, reference):
        raise VerifierInfraError("sandbox could not start: /proc is read-only")

    monkeypatch.setitem(registry.VERIFIERS, "broken", VerifierSpec("test", lambda _config: broken))
    monkeypatch.setitem(KNOWN_VERIFIERS, "broken", "test")
    config = RoundConfig.model_validate(
        {
            "verify": {"verifier": "broken", "infra_retry_budget": 8},
            "rollout": {"samples_per_prompt": 2, "max_tokens": 2, "max_prompts_factor": 2},
            "train": {"groups_per_step": 2, "steps_per_round": 1},
        }
    )
    ctx = RoundContext(
        storage=str(tmp_path),
        run_id="broken",
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
        seed=0,
    )
    with pytest.raises(InfraFailureRateError, match="100.0% of samples failed for infrastructure reasons"):
        run_rollout(
            ctx=ctx,
            prompts=config.prompts,
            rollout=config.rollout,
            verify=config.verify_resolved,
            filtering=config.filter,
            target_groups=config.target_groups,
            engines=own_engines.engines,
        )
    root = StorageRoot.of(str(tmp_path))
    assert not root.fs.exists(os.path.dirname(root.campaign_file("broken")))  # nothing of the run was written
