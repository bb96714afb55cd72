"""Speculative rollout (models/engines/speculative.py): every sample is plain sampling's, drafts only save steps.

- exactness: per seed, a speculative sample is the plain one; over many seeds, the continuations' frequencies
  match their exact probabilities, enumerated from the model (a chi-square test that a wrong acceptance rule fails);
- drafts always right cut a sample's decode steps to about n / (k + 1); drafts always wrong cost none;
- logprobs are the policy's own (a forward pass of the trainer's scoring agrees within 1e-4), versions are the
  engine's, partial samples resume to the same rows, and the index finds references as documented.
"""

from __future__ import annotations

import math
import os
from collections import Counter

import pytest
import torch

import models.engines.speculative as speculative
from models.checkpoint import load_policy
from models.engines.embedded import EmbeddedEngine
from models.engines.speculative import DraftIndex, Follow, Speculation
from models.engines.types import GroupRequest, SamplingParams
from models.logprobs import nucleus_drop, pack_sequences, token_logprobs


@pytest.fixture(scope="module")
def policy(tiny_policy_dir):
    return load_policy(tiny_policy_dir)


class FixedDrafts(DraftIndex):
    """A draft source for testing the verifier: ``draft(generated)`` is what a sample is offered next."""

    def __init__(self, draft):
        super().__init__()
        self.draft = draft

    def find(self, prompt, generated):
        proposal = tuple(self.draft(tuple(generated)))
        return Follow(tuple(generated) + proposal, len(generated)) if proposal else None


def _engine(policy, **kw):
    model, tok = policy
    return EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, kv_cache="slots", **kw)


def _run(engine, requests, speculation=None):
    engine.speculate(speculation)
    return {(s.group_id, s.sample_index): s for s in engine.generate(requests)}


def _group(tok, n, params, prompt="12+34=", gid="g"):
    return GroupRequest(gid, tuple(tok(prompt)["input_ids"]), n, params)


# -- exactness ---------------------------------------------------------------------------------------


def exact_probabilities(model, prompt: tuple[int, ...], eos: int, max_tokens: int, temperature: float, top_p: float):
    """Every continuation of up to ``max_tokens`` tokens (ending at eos or the limit) -> its probability under
    plain sampling at ``temperature`` and ``top_p``, by enumeration."""
    out: dict[tuple[int, ...], float] = {}
    frontier = {(): 1.0}
    for step in range(max_tokens):
        prefixes = list(frontier)
        ids = torch.tensor([[*prompt, *p] for p in prefixes])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, -1].float() / temperature
        if top_p < 1:
            logits = logits.masked_fill(nucleus_drop(logits, torch.full((len(prefixes), 1), top_p)), float("-inf"))
        probs = logits.softmax(-1)
        following = {}
        for row, prefix in enumerate(prefixes):
            for token, p in enumerate(probs[row].tolist()):
                if p == 0:
                    continue
                seq, mass = prefix + (token,), frontier[prefix] * p
                if token == eos or step == max_tokens - 1:
                    out[seq] = out.get(seq, 0.0) + mass
                else:
                    following[seq] = mass
        frontier = following
    return out


def chi_square_p(counts: Counter, exact: dict, n: int) -> float:
    """P-value of the counts against ``exact`` (cells expected below 5 pooled into one)."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for seq, p in exact.items():
        expected = n * p
        if expected < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(seq, 0), pooled_exp + expected
            continue
        stat += (counts.get(seq, 0) - expected) ** 2 / expected
        cells += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    dof = cells - 1
    # Wilson-Hilferty: the chi-square tail through a normal one (accurate from about ten degrees of freedom)
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def small_vocab():
    """A random tiny Llama over 5 tokens (0 pad, 1 eos), its output layer scaled so its distributions are far
    from uniform: every 3-token continuation can be enumerated and each has a measurable probability."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=5,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(12)
    return model


SAMPLES = 12_000
EXACT_P = 1e-3
"""The exactness test's level: a correct rule fails it one run in a thousand by chance (the seeds are fixed, so
a run's outcome does not change from run to run); the wrong rules below score p-values far below it."""


def _speculative_counts(model, params, draft_token: int, prompt_ids):
    engine = EmbeddedEngine(model, 1, 0, max_batch=1024, kv_cache="slots")
    drafts = FixedDrafts(lambda generated: [draft_token] * 3)
    samples = _run(engine, [GroupRequest("g", prompt_ids, SAMPLES, params)], Speculation(drafts, k=3, step_tokens=4096))
    return Counter(tuple(s.token_ids) for s in samples.values()), engine


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_speculative_samples_are_distributed_as_plain_sampling(small_vocab, temperature, top_p, monkeypatch):
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=3, seed=3)
    prompt_ids = (2, 3, 4, 3)
    exact = exact_probabilities(small_vocab, prompt_ids, 1, 3, temperature, top_p)
    assert abs(sum(exact.values()) - 1) < 1e-4
    # drafts of the token most often drawn second: often right, often wrong
    second = Counter()
    for seq, p in exact.items():
        if len(seq) > 1:
            second[seq[1]] += p
    draft_token = second.most_common(1)[0][0]
    counts, engine = _speculative_counts(small_vocab, params, draft_token, prompt_ids)
    stats = engine.speculation_stats
    assert 0 < stats.accepted < stats.drafted  # the drafts were both accepted and rejected
    assert chi_square_p(counts, exact, SAMPLES) > EXACT_P

    # The test has the power to see a wrong rule: trusting the first drafted token outright.
    def trusting(draws, draft):
        return [draft[0], *draws[1:2]] if draft else list(draws[:1])

    monkeypatch.setattr(speculative, "accepted_tokens", trusting)
    wrong, _ = _speculative_counts(small_vocab, params, draft_token, prompt_ids)
    assert chi_square_p(wrong, exact, SAMPLES) < 1e-9


def test_speculative_samples_are_the_plain_ones_seed_for_seed(policy):
    model, tok = policy
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=11)
    requests = lambda: [_group(tok, 16, params, p, f"g{i}") for i, p in enumerate(["1+2=", "34+56=", "99+1="])]  # noqa: E731
    plain = _run(_engine(policy, max_batch=8), requests())
    index = DraftIndex(match=1)
    for s in plain.values():  # drafts from the same prompts' completions: many right, many wrong
        index.add(s.prompt_token_ids, s.token_ids[::-1] if s.sample_index % 2 else s.token_ids)
    engine = _engine(policy, max_batch=8)
    spec = _run(engine, requests(), Speculation(index, k=4, step_tokens=64))
    assert engine.speculation_stats.accepted > 0
    assert {k: s.token_ids for k, s in spec.items()} == {k: s.token_ids for k, s in plain.items()}
    for key, s in spec.items():
        assert s.logprobs == pytest.approx(plain[key].logprobs, abs=1e-4)


# -- steps saved -------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 7])
def test_drafts_always_right_cut_steps_to_n_over_k_plus_1(policy, k):
    model, tok = policy
    n = 25
    params = SamplingParams(temperature=1.0, max_tokens=n, seed=5, ignore_eos=True)
    plain_engine = _engine(policy, max_batch=4)
    plain = _run(plain_engine, [_group(tok, 1, params)])
    assert plain_engine.decode_steps == n - 1  # the first token comes from the prefill
    (truth,) = [tuple(s.token_ids) for s in plain.values()]
    engine = _engine(policy, max_batch=4)
    drafts = FixedDrafts(lambda generated: truth[len(generated) :])
    spec = _run(engine, [_group(tok, 1, params)], Speculation(drafts, k=k, step_tokens=64))
    assert [tuple(s.token_ids) for s in spec.values()] == [truth]
    assert engine.decode_steps == math.ceil((n - 1) / (k + 1))
    assert engine.speculation_stats.accepted == engine.speculation_stats.drafted


def test_drafts_always_wrong_cost_no_steps(policy):
    model, tok = policy
    n = 20
    params = SamplingParams(temperature=1.0, max_tokens=n, seed=5, ignore_eos=True)
    plain = _run(_engine(policy, max_batch=4), [_group(tok, 3, params)])
    engine = _engine(policy, max_batch=4)
    never = FixedDrafts(lambda generated: [tok.eos_token_id] * 4)  # masked out under ignore_eos: never drawn
    spec = _run(engine, [_group(tok, 3, params)], Speculation(never, k=4, step_tokens=64))
    assert engine.speculation_stats.accepted == 0 and engine.speculation_stats.drafted > 0
    assert engine.decode_steps == n - 1
    assert {k: s.token_ids for k, s in spec.items()} == {k: s.token_ids for k, s in plain.items()}


def test_step_tokens_bounds_what_a_step_feeds(policy):
    model, tok = policy
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=5, ignore_eos=True)
    engine = _engine(policy, max_batch=8)
    drafts = FixedDrafts(lambda generated: [3] * 8)
    _run(engine, [_group(tok, 8, params)], Speculation(drafts, k=8, step_tokens=8))  # 8 rows fill the budget
    assert engine.speculation_stats.drafted == 0
    _run(engine, [_group(tok, 8, params)], Speculation(drafts, k=8, step_tokens=12))
    stats = engine.speculation_stats
    assert 0 < stats.drafted <= 4 * stats.verify_steps


# -- what is recorded ------------------------------------------------------------------------------


def test_logprobs_are_the_policys_own_and_versions_the_engines(policy):
    model, tok = policy
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=2)
    requests = [_group(tok, 6, params, p, f"g{i}") for i, p in enumerate(["5+5=", "67+8="])]
    plain = _run(_engine(policy, max_batch=16), list(requests))
    index = DraftIndex(match=1)
    for s in plain.values():
        index.add(s.prompt_token_ids, s.token_ids)
    engine = _engine(policy, max_batch=16, policy_version=7)
    spec = list(_run(engine, list(requests), Speculation(index, k=4, step_tokens=64)).values())
    assert engine.speculation_stats.accepted > 0
    batch = pack_sequences([list(s.prompt_token_ids) for s in spec], [s.token_ids for s in spec], tok.pad_token_id)
    with torch.no_grad():
        scored = token_logprobs(model, batch, temperature=0.8, top_p=torch.full((len(spec),), 0.9))
    width = batch.input_ids.shape[1] - 1
    for row, s in enumerate(spec):
        assert s.token_policy_versions == [7] * len(s.token_ids)
        mask = batch.completion_mask[row].bool()
        assert scored[row][mask].tolist() == pytest.approx(s.logprobs, abs=1e-4), width


def test_partial_samples_resume_to_the_uninterrupted_rows(policy):
    model, tok = policy
    params = SamplingParams(temperature=1.0, max_tokens=14, seed=9, ignore_eos=True)
    plain = _run(_engine(policy, max_batch=8), [_group(tok, 4, params)])
    index = DraftIndex(match=1)
    for s in plain.values():
        index.add(s.prompt_token_ids, s.token_ids)
    engine = _engine(policy, max_batch=8)
    engine.speculate(Speculation(index, k=3, step_tokens=64))
    polls = iter(range(1000))
    partial = list(engine.generate([_group(tok, 4, params)], should_stop=lambda: next(polls) >= 2))
    assert all(s.partial and 0 < len(s.token_ids) < 14 for s in partial)
    resumed = {
        s.sample_index: s
        for s in engine.generate([GroupRequest("g", partial[0].prompt_token_ids, 4, params, tuple(partial))])
    }
    assert {i: s.token_ids for i, s in resumed.items()} == {k[1]: s.token_ids for k, s in plain.items()}


def test_padded_cache_says_it_cannot_speculate(policy):
    model, tok = policy
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, kv_cache="padded")
    assert "slot cache" in engine.speculate(Speculation(DraftIndex()))


# -- the index -------------------------------------------------------------------------------------


def test_index_prefers_the_prompts_own_completions_then_the_longest_context():
    index = DraftIndex(match=2)
    index.add((1, 2), (5, 6, 7, 8))
    index.add((9, 9), (3, 5, 6, 4))
    own = index.find((1, 2), (5,))  # the prompt's own completion, by prefix
    assert own.reference[own.position :] == (6, 7, 8)
    hit = index.find((7, 7), (3, 5, 6))  # another prompt's: the context (5, 6) was written by both
    assert hit.reference[hit.position :] == (4,)  # the newest completion with that context wins
    assert index.find((7, 7), (0, 0)) is None
    history = DraftIndex(match=2)
    history.add_all([((1,), (4, 4, 4), None), ((1,), (4, 4, 5), None)])  # newest first: the first is preferred
    first = history.find((1,), (4, 4))
    assert first.reference[first.position :] == (4,)


def test_drafts_are_cut_where_the_reference_was_unlikely():
    index = DraftIndex(match=1)
    index.add((1,), (5, 6, 7, 8), [math.log(0.9), math.log(0.9), math.log(0.2), math.log(0.9)])
    follow = index.find((1,), ())
    assert follow.draft(4, 0.0) == [5, 6, 7, 8]
    assert follow.draft(4, 0.5) == [5, 6]  # 0.9 * 0.9 = 0.81, then 0.16 < 0.5
    assert follow.draft(1, 0.5) == [5]


def test_index_is_bounded():
    index = DraftIndex(match=1, max_tokens=10)
    for start in range(5):
        index.add((start,), tuple(range(start, start + 4)))
    assert index.indexed_tokens == 12  # stops adding once past the bound
    assert index.index_s > 0


# -- a campaign with speculation on ---------------------------------------------------------------


@pytest.mark.slow
def test_a_speculative_campaign_stores_the_rows_plain_sampling_stores(tiny_campaign, seed_builtin_base, tmp_path):
    """The shared tiny campaign again with speculation on (drafts from the previous round and this round's samples):
    the same trajectories, round for round; its figures in MLflow and the health report; a replay of its round 2
    trains the same weights; and it resumes with other speculation settings (not part of a stage's inputs)."""
    import copy

    from mlflow import MlflowClient

    from flows.campaign import rl_campaign
    from flows.config import CampaignConfig
    from storage.paths import StorageRoot
    from storage.tracking import KIND_TAG, ROUND_TAG
    from storage.trajectories import committed_round_version, read_table
    from tasks.round.report import health_report

    storage = str(tmp_path / "data")
    seed_builtin_base(storage)
    config = copy.deepcopy(tiny_campaign["config"])
    config["round"]["rollout"] = {
        "speculative": {"enabled": True, "history_rounds": 1, "match_tokens": 1, "step_tokens": 8192}
    }
    config["rounds"] = 2
    spec_rounds = rl_campaign(CampaignConfig.model_validate(config), storage=storage)["rounds"]

    def rows(root: str, round_index: int) -> dict:
        version = committed_round_version(StorageRoot.of(root), "tiny", round_index)
        table = read_table(StorageRoot.of(root), version, ["group_id", "sample_index", "completion_token_ids"])
        return {(r["group_id"], r["sample_index"]): r["completion_token_ids"] for r in table.to_pylist()}

    for k in (1, 2):
        assert rows(storage, k) == rows(tiny_campaign["storage"], k)

    client = MlflowClient(tracking_uri=f"sqlite:///{storage}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("rlrounds").experiment_id], f"tags.`{KIND_TAG}` = 'round'")
    by_round = {int(r.data.tags[ROUND_TAG]): r.data.metrics for r in runs if r.data.tags[ROUND_TAG] != "0"}
    assert set(by_round) == {1, 2}
    for metrics in by_round.values():
        assert metrics["rollout/speculative"] == 1.0
        assert 0 <= metrics["rollout/spec_acceptance"] <= 1 and metrics["rollout/spec_indexed_tokens"] > 0
        assert metrics["rollout/spec_accepted_tokens"] <= metrics["rollout/spec_drafted_tokens"]
    assert by_round[2]["rollout/spec_history_s"] > 0  # round 1's completions, read from the store
    report = health_report("tiny", 2, by_round[2], None, None)
    assert "| speculative rollout | decode steps |" in report and "draft acceptance" in report

    # The stage's own pieces on this store: the history of rounds 1-2 drafts a third round's collection, whose rows
    # are the plain collection's.
    from flows.config import RoundConfig
    from tasks.rollout.collection import RolloutCollection
    from tasks.rollout.speculation import RoundSpeculation
    from tasks.serving.engines import make_engine

    rc = RoundConfig.model_validate(config["round"])
    base = StorageRoot.of(storage).base_policy("builtin-addition-v2")
    engine, tokenizer = make_engine("embedded", base, dtype="float32", policy_version=0, max_batch=64)
    collected = {}
    for on in (False, True):
        settings = rc.rollout.speculative.model_copy(update={"enabled": on})
        speculation = RoundSpeculation(engine, settings, StorageRoot.of(storage), "tiny", 3)
        assert speculation.why_not is None and (speculation.index is not None) == on
        result = RolloutCollection(
            engine,
            tokenizer,
            prompts=rc.prompts,
            rollout=rc.rollout,
            verify=rc.verify_resolved,
            filtering=rc.filter,
            target_groups=32,
            seed=5,
            run_id="tiny",
            round_index=3,
        ).collect()
        figures = speculation.finish()
        assert figures["rollout/decode_steps"] > 0
        collected[on] = {(r.group_id, r.sample_index): r.completion_token_ids for r in result.rows}
    # Each finished sample is the plain one; which groups finish before the batch is full can differ (samples advance
    # by more than a token a step), as a partial rollout's stop point does.
    both = collected[True].keys() & collected[False].keys()
    assert len(both) >= 0.8 * len(collected[False])
    assert {k: collected[True][k] for k in both} == {k: collected[False][k] for k in both}
    assert figures["rollout/spec_indexed_tokens"] > sum(len(v) for v in collected[True].values())  # history too
    assert 0 < figures["rollout/spec_accepted_tokens"] <= figures["rollout/spec_drafted_tokens"]
    assert figures["rollout/spec_tokens_per_verify_step"] > 1

    # a replay of round 2 with speculation on in its config trains the same weights, bit for bit
    from flows.config import ReplayRequest
    from flows.replay import rl_replay

    replayed = rl_replay(
        ReplayRequest(
            trajectories=spec_rounds[2]["trajectory_version"],
            from_model=spec_rounds[1]["model_version"],
            config=CampaignConfig.model_validate(config).round,
        ),
        storage=storage,
    )
    weights = [
        open(os.path.join(d, "model.safetensors"), "rb").read()
        for d in (replayed["checkpoint"], StorageRoot.of(storage).checkpoint("tiny", 2))
    ]
    assert weights[0] == weights[1]

    # resumed with speculation off, on a named device and with another GPU share: none is a stage input
    config["rounds"] = 3
    config["round"]["rollout"] = {"speculative": {"enabled": False}, "gpu_memory_utilization": 0.3}
    config["round"]["device"] = "cpu"
    result = rl_campaign(CampaignConfig.model_validate(config), storage=storage, resume=True)
    assert [r["round"] for r in result["rounds"]] == [0, 1, 2, 3]
    assert rows(storage, 3) == rows(tiny_campaign["storage"], 3)


def test_an_engine_that_cannot_verify_drafts_generates_plainly_and_says_why(policy, tmp_path):
    from types import SimpleNamespace

    from models.engines.types import EngineInfo
    from storage.paths import StorageRoot
    from tasks.config.rollout import SpeculativeConfig
    from tasks.rollout.speculation import speculation_figures, start_speculation
    from tasks.round.report import health_report

    model, tok = policy
    root, on = StorageRoot.of(str(tmp_path)), SpeculativeConfig(enabled=True)
    padded = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, kv_cache="padded")
    vllm_like = SimpleNamespace(info=EngineInfo("vllm", "0.32.0", "float32"))  # an engine with no speculate()
    for engine, says in ((padded, "slot cache"), (vllm_like, "vllm engine does not draft")):
        index, why_not = start_speculation(engine, on, root, "run", 2)
        assert index is None and says in why_not
        figures = speculation_figures(index, None, 5, why_not)
        assert figures["rollout/speculative"] == 0 and figures["rollout/speculative_unavailable"] == 1
        assert "the engine cannot" in health_report("run", 2, figures, None, None)
    off = speculation_figures(None, None, 5, None)
    assert "| speculative rollout | off |" in health_report("run", 2, off, None, None)
