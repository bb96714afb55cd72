"""Engine replicas as Ray actors: the router is an engine like any other (same samples, same rows),
keeps a prompt's groups on one replica, publishes weights to every replica, and a real round with two
replicas completes every group it starts.

Ray is started once for the module (2 logical CPUs, one per replica); replicas run the embedded
engine, so the suite needs no vLLM.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

from models.engines.embedded import EmbeddedEngine  # noqa: E402
from models.engines.types import GroupRequest, SamplingParams  # noqa: E402
from tasks.serving.engines import Placement, build_engine  # noqa: E402

PROMPTS = ["1+2=", "34+56=", "7+89=", "99+99=", "5+5=", "12+21=", "8+0=", "40+4="]
CAMPAIGN = {
    "rounds": 1,
    "run_id": "ray",
    "round": {
        "rollout": {"replicas": 2, "max_batch": 64},
        "train": {"groups_per_step": 4, "steps_per_round": 2},
        "publish": {"model_name": "it-ray"},
    },
}


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()  # every test and campaign here closed the replica sets it started


@pytest.fixture(scope="module")
def router(tiny_policy_dir):
    from tasks.serving.engines import make_engine

    engine, tokenizer = make_engine(
        "embedded", tiny_policy_dir, dtype="float32", policy_version=0, max_batch=16, placement=Placement(2)
    )
    yield engine, tokenizer
    engine.close()


def _requests(tokenizer, n, params, prompts=PROMPTS):
    return [GroupRequest(f"g{i}", tuple(tokenizer(p)["input_ids"]), n, params) for i, p in enumerate(prompts)]


def test_replicas_give_the_samples_one_engine_gives(router, tiny_policy_dir):
    engine, tok = router
    assert engine.replicas == 2 and engine.info.name == "embedded"
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=9)
    got = {(s.group_id, s.sample_index): (s.token_ids, s.logprobs) for s in engine.generate(_requests(tok, 4, params))}
    single = build_engine("embedded", tiny_policy_dir, dtype="float32", policy_version=0)
    expected = {
        (s.group_id, s.sample_index): (s.token_ids, s.logprobs) for s in single.generate(_requests(tok, 4, params))
    }
    assert got.keys() == expected.keys() and len(got) == 4 * len(PROMPTS)  # every group complete
    for key, (tokens, logprobs) in got.items():  # per-sample seeds: the replica does not matter
        assert tokens == expected[key][0] and logprobs == pytest.approx(expected[key][1], abs=1e-5)


def test_groups_of_one_prompt_stay_on_one_replica(router):
    from models.engines.replicas import replica_for

    engine, tok = router
    prompts = PROMPTS * 3  # each prompt three times, as three groups
    before = list(engine.routed)
    requests = _requests(tok, 2, SamplingParams(temperature=1.0, max_tokens=4, seed=1), prompts)
    samples = list(engine.generate(requests))
    assert len(samples) == 2 * len(prompts)
    sent = [after - b for after, b in zip(engine.routed, before)]
    expected = [0, 0]
    for r in requests:
        expected[replica_for(r.prompt_token_ids, 2)] += 1
    assert sent == expected and all(sent)  # both replicas used, each prompt's groups on its replica
    assert replica_for((1, 2, 3), 2) == replica_for((1, 2, 3), 2)


def test_the_router_stops_pulling_when_the_caller_stops_feeding(router):
    engine, tok = router
    pulled = []

    def feed():
        for r in _requests(tok, 2, SamplingParams(temperature=1.0, max_tokens=4, seed=2)) * 50:
            pulled.append(r)
            yield r

    stream = engine.generate(feed())
    next(stream)
    stream.close()
    # at most two calls per replica, plus one call's worth of routed-ahead groups
    assert len(pulled) <= engine.groups_per_call * (2 * engine.replicas + 1) < 400


def test_the_router_is_a_rollout_engine_counting_its_replicas_steps(router):
    from models.engines.types import RolloutEngine

    engine, tok = router
    assert isinstance(engine, RolloutEngine)
    before = engine.decode_steps
    samples = list(engine.generate(_requests(tok, 1, SamplingParams(temperature=0.0, max_tokens=3))))
    assert engine.decode_steps - before >= max(len(s.token_ids) for s in samples) - 1  # prefills not counted
    with pytest.raises(ValueError, match="rollout.replicas 1"):  # weights load between calls only
        next(engine.generate(_requests(tok, 1, SamplingParams()), None, object()))


def test_weights_reach_every_replica_in_place(router, tiny_policy_dir, tmp_path):
    import torch

    from models.checkpoint import load_policy, save_policy

    engine, tok = router
    model, _ = load_policy(tiny_policy_dir)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    save_policy(model, tok, str(tmp_path))
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    before = {s.group_id: s.token_ids for s in engine.generate(_requests(tok, 1, greedy))}

    assert engine.load_weights(str(tmp_path), 4) >= 0.0 and engine.policy_version == 4
    assert [version for _, version in ray.get([a.describe.remote() for a in engine.actors])] == [4, 4]
    after = list(engine.generate(_requests(tok, 1, greedy)))
    expected = {
        s.group_id: s.token_ids
        for s in EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id).generate(_requests(tok, 1, greedy))
    }
    assert {s.group_id: s.token_ids for s in after} == expected != before
    assert all(s.token_policy_versions == [4] * len(s.token_ids) for s in after)
    engine.load_weights(tiny_policy_dir, 0)


# -- a real round ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def campaign(prefect_harness, seed_builtin_base, tmp_path_factory):
    """The campaign, and what each engine it released served when its flow finished."""
    from flows.campaign import rl_campaign
    from flows.config import CampaignConfig
    from models.engines.embedded import EmbeddedEngine
    from models.engines.replicas import ReplicaRouter

    storage = str(tmp_path_factory.mktemp("ray") / "data")
    seed_builtin_base(storage)
    released = []
    closes = {kind: kind.close for kind in (EmbeddedEngine, ReplicaRouter)}

    def observed(close):
        def observed_close(engine):
            actors = getattr(engine, "actors", [])
            released.append((engine, [version for _, version in ray.get([a.describe.remote() for a in actors])]))
            close(engine)

        return observed_close

    for kind, close in closes.items():
        kind.close = observed(close)
    try:
        result = rl_campaign(CampaignConfig.model_validate(CAMPAIGN), storage=storage)
    finally:
        for kind, close in closes.items():
            kind.close = close
    return storage, result, released


def test_a_round_on_two_replicas_completes_every_group_with_the_usual_rows(campaign):
    from models.engines.replicas import ReplicaRouter
    from storage.paths import StorageRoot
    from storage.trajectories import arrow_schema, list_manifests, read_table
    from tasks.config.rollout import RolloutConfig

    storage, result, released = campaign
    root = StorageRoot.of(storage)
    (manifest,) = list_manifests(root)
    table = read_table(root, manifest)
    assert set(arrow_schema().names) | {"trajectory_version"} == set(table.column_names)
    rows = table.to_pylist()
    sizes: dict[str, int] = {}
    for r in rows:
        sizes[r["group_id"]] = sizes.get(r["group_id"], 0) + 1
        assert r["engine"]["name"] == "embedded" and r["token_policy_versions"] == [0] * len(r["completion_token_ids"])
        assert len(r["completion_token_ids"]) == len(r["rollout_logprobs"]) >= 1 and r["outcome"] in (
            "success",
            "model_failure",
        )
    assert set(sizes.values()) == {RolloutConfig().samples_per_prompt}  # every group started was completed
    assert len({r["group_id"] for r in rows if r["kept"]}) == 8
    assert result["rounds"][1]["accuracy"] >= 0.0

    # publish reached the replicas in place: the router was serving round 1 when the campaign released it
    # at its end (its actors gone with it: a worker process keeps nothing of a finished campaign). Before
    # it, the base's evaluation engine was closed when rollout asked for two replicas.
    (*replaced, (engine, versions)) = released
    assert isinstance(engine, ReplicaRouter) and engine.replicas == 2 and versions == [1, 1]
    assert not any(isinstance(e, ReplicaRouter) for e, _ in replaced)


def test_verifier_calls_run_as_ray_tasks_and_keep_their_failure_class():
    """verify.on_ray: each call runs in a Ray worker process; an infrastructure error raised there is
    still infrastructure (not retryable when it says so), and the pool's bookkeeping is unchanged."""
    import os

    from tasks.config.verify import VerifyConfig
    from tasks.verifiers.on_ray import RayVerifier
    from tasks.verifiers.outcome import Outcome, Verdict, VerifierInfraError
    from tasks.verifiers.pool import VerifierPool, run_verifier
    from tasks.verifiers.registry import rollout_verifier

    def where(text: str, reference: str) -> Verdict:  # closures travel by value to the workers
        right = text == reference
        return Verdict(float(right), Outcome.SUCCESS if right else Outcome.MODEL_FAILURE, f"pid {os.getpid()}")

    def broken(text: str, reference: str) -> Verdict:
        raise VerifierInfraError("sandbox gone", retryable=False)

    verdict = RayVerifier(where)("7", "7")
    assert verdict.outcome == Outcome.SUCCESS and verdict.error != f"pid {os.getpid()}"
    failed = run_verifier(RayVerifier(broken), "7", "7")
    assert failed.outcome == Outcome.INFRA_FAILURE and "sandbox gone" in failed.error
    with VerifierPool(RayVerifier(where), workers=4, retries=1) as pool:
        verdicts = [pool.submit(str(i), str(i % 2)).result() for i in range(6)]
    assert [v.reward for v in verdicts] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    scored = rollout_verifier("addition", VerifyConfig(on_ray=True), round_seed=0)
    assert isinstance(scored, RayVerifier) and scored("12", "12").outcome == Outcome.SUCCESS
