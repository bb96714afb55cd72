"""The embedded engine: same answers as transformers' generate, logprobs the trainer agrees with,
and samples that do not depend on how they were batched."""

import pytest
import torch

from models.checkpoint import load_policy
from models.engines.embedded import EmbeddedEngine
from models.engines.types import GroupRequest, SamplingParams
from models.logprobs import pack_sequences, token_logprobs

PROMPTS = ["1+2=", "34+56=", "7+89=", "99+99=", "5+5="]


@pytest.fixture(scope="module")
def policy(tiny_policy_dir):
    return load_policy(tiny_policy_dir)


@pytest.fixture(params=["slots", "padded"])
def kv(request):
    """Every engine test runs on both KV caches (models/engines/kv_cache.py)."""
    return request.param


def _requests(tokenizer, n, params, prefix="g"):
    return [GroupRequest(f"{prefix}{i}", tuple(tokenizer(p)["input_ids"]), n, params) for i, p in enumerate(PROMPTS)]


def test_greedy_matches_transformers_generate(policy, kv):
    model, tok = policy
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=2, kv_cache=kv)  # forces refills
    got = {
        s.group_id: s.token_ids
        for s in engine.generate(_requests(tok, 1, SamplingParams(temperature=0.0, max_tokens=6)))
    }
    enc = tok(PROMPTS, padding=True, return_tensors="pt")
    out = model.generate(
        **enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    )
    for i in range(len(PROMPTS)):
        expected = out[i, enc["input_ids"].shape[1] :].tolist()
        if tok.eos_token_id in expected:
            expected = expected[: expected.index(tok.eos_token_id) + 1]
        else:
            expected = [t for t in expected if t != tok.pad_token_id]
        assert got[f"g{i}"] == expected


def test_samples_do_not_depend_on_batching(policy, kv):
    model, tok = policy
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=7)
    runs = []
    for max_batch in (3, 64):
        engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=max_batch, kv_cache=kv)
        runs.append({(s.group_id, s.sample_index): s.token_ids for s in engine.generate(_requests(tok, 4, params))})
    assert runs[0] == runs[1]
    assert len(runs[0]) == len(PROMPTS) * 4


def test_behaviour_logprobs_match_the_trainer(policy, kv):
    model, tok = policy
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=8, kv_cache=kv)
    samples = list(engine.generate(_requests(tok, 3, SamplingParams(temperature=0.7, max_tokens=8, seed=1))))
    batch = pack_sequences(
        [list(s.prompt_token_ids) for s in samples], [s.token_ids for s in samples], tok.pad_token_id
    )
    with torch.no_grad():
        trainer = token_logprobs(model, batch, temperature=0.7)
    width = batch.input_ids.shape[1] - max(len(s.token_ids) for s in samples)
    for row, s in enumerate(samples):
        got = trainer[row, width - 1 : width - 1 + len(s.token_ids)]
        assert torch.allclose(got, torch.tensor(s.logprobs), atol=1e-4)


def test_finish_reasons_and_policy_versions(policy, kv):
    model, tok = policy
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, policy_version=3, kv_cache=kv)
    samples = list(engine.generate(_requests(tok, 2, SamplingParams(temperature=1.0, max_tokens=3, seed=2))))
    for s in samples:
        assert s.finish_reason in ("stop", "length")
        assert (s.finish_reason == "stop") == (s.token_ids[-1] == tok.eos_token_id)
        assert len(s.token_ids) <= 3 and s.token_policy_versions == [3] * len(s.token_ids)
        assert s.finished_at >= s.started_at


def test_ignore_eos_generates_exactly_max_tokens(policy, kv):
    model, tok = policy
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, kv_cache=kv)
    samples = list(
        engine.generate(_requests(tok, 2, SamplingParams(temperature=1.0, max_tokens=5, seed=3, ignore_eos=True)))
    )
    assert all(len(s.token_ids) == 5 and tok.eos_token_id not in s.token_ids for s in samples)


def test_the_engine_counts_its_decode_steps_not_its_prefills(policy, kv):
    model, tok = policy
    params = SamplingParams(temperature=1.0, max_tokens=5, seed=3, ignore_eos=True)
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=16, kv_cache=kv)
    list(engine.generate(_requests(tok, 2, params)))  # 10 rows at once: a prefill's token, then 4 steps
    assert engine.decode_steps == 4
    list(engine.generate(_requests(tok, 2, params)))
    assert engine.decode_steps == 8  # cumulative: benchmarks read the difference
    waves = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=4, kv_cache=kv)
    list(waves.generate(_requests(tok, 2, params)))  # 4 + 4 + 2 rows: three waves of 4 steps
    assert waves.decode_steps == 12


def test_top_p_keeps_only_the_nucleus(policy, kv):
    model, tok = policy
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, kv_cache=kv)
    # top_p tiny: only the most likely token survives, so sampling equals greedy
    tiny = {
        s.group_id: s.token_ids
        for s in engine.generate(_requests(tok, 1, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=5, seed=4)))
    }
    greedy = {
        s.group_id: s.token_ids
        for s in engine.generate(_requests(tok, 1, SamplingParams(temperature=0.0, max_tokens=5)))
    }
    assert tiny == greedy


def test_sampling_follows_the_softmax():
    from models.engines.embedded import _Sequence, sample_tokens

    # 4000 independent samples from one fixed distribution: frequencies within 3 standard errors
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    group = GroupRequest("g", (1,), 4000, SamplingParams(temperature=1.0, seed=11))
    seqs = [_Sequence(group, i, seed=1000 + i) for i in range(4000)]
    tokens, logprobs = sample_tokens(probs.log().repeat(4000, 1), seqs, stop_token_ids=99)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    stderr = (probs * (1 - probs) / 4000).sqrt()
    assert ((freq - probs).abs() < 3 * stderr + 1e-3).all(), freq
    assert torch.allclose(logprobs, probs.log()[tokens])


def test_a_flow_releases_the_engines_it_opened_and_a_borrowed_set_stays_open(tiny_policy_dir, monkeypatch):
    """A campaign's engines must not outlive it in a long-lived worker; a round given its campaign's engines
    shares them and leaves them open; a round on its own opens and releases its own."""
    from flows.resources import CampaignResources, held
    from models.engines.embedded import EmbeddedEngine

    closed = []
    close = EmbeddedEngine.close
    monkeypatch.setattr(EmbeddedEngine, "close", lambda engine: (closed.append(engine), close(engine)))

    def serve(resources, dtype):
        return resources.engines.serve("embedded", tiny_policy_dir, dtype=dtype, policy_version=0)[0]

    with CampaignResources() as campaign:
        outer = serve(campaign, "float32")
        with held(campaign) as borrowed:  # a round of the campaign
            reused, built = serve(borrowed, "float32"), serve(borrowed, "bfloat16")
        assert reused is outer and closed == []  # the campaign's: still live
        with held(None) as own:  # a round on its own
            mine = serve(own, "float32")
        assert mine is not outer and closed == [mine]
    assert closed == [mine, outer, built]  # the campaign's end releases every engine it held
    with pytest.raises(RuntimeError, match="closed"):
        serve(campaign, "float32")  # nothing serves from a closed set


# -- partial rollouts: stop mid-generation, load new weights, resume ---------------------------------


def _perturbed(model, scale: float = 0.5):
    """Another policy of the same shape: the same weights plus noise (a stand-in for one training round)."""
    import copy

    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return other


def _teacher_forced(model, sample, temperature, banned: int):
    """Logprobs [T] of the sample's tokens under ``model`` from one forward pass over prompt + completion,
    with token ``banned`` masked (the engine never samples eos under ignore_eos)."""
    ids = torch.tensor([list(sample.prompt_token_ids) + sample.token_ids])  # [1, P+T]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature  # [P+T-1, V]
    logits[:, banned] = float("-inf")
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)  # [P+T-1]
    return logp[len(sample.prompt_token_ids) - 1 :]


def test_stopped_samples_come_back_partial_and_resume_under_new_weights(policy, tmp_path, kv):
    from models.checkpoint import save_policy

    model, tok = policy
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=9, ignore_eos=True)  # every sample runs 12 tokens
    import copy

    # 1 sample waits; weights change below
    engine = EmbeddedEngine(copy.deepcopy(model), tok.eos_token_id, tok.pad_token_id, max_batch=3, kv_cache=kv)
    steps = 0

    def stop_after_five_steps() -> bool:
        nonlocal steps
        steps += 1
        return steps > 5

    requests = _requests(tok, 2, params)[:2]
    first = list(engine.generate(requests, stop_after_five_steps))
    # 2 groups x 2 samples, all back
    assert len(first) == 4 and all(s.partial and s.finish_reason == "abort" for s in first)
    assert sorted(len(s.token_ids) for s in first) == [0, 5, 5, 5]  # 3 admitted ran 5 steps; 1 never started
    for s in first:
        assert s.token_policy_versions == [0] * len(s.token_ids) and len(s.logprobs) == len(s.token_ids)

    newer = _perturbed(model)
    save_policy(newer, tok, str(tmp_path))
    engine.load_weights(str(tmp_path), policy_version=1)
    resumed_requests = [
        GroupRequest(
            r.group_id, r.prompt_token_ids, r.n, r.sampling, tuple(s for s in first if s.group_id == r.group_id)
        )
        for r in requests
    ]
    second = {(s.group_id, s.sample_index): s for s in engine.generate(resumed_requests)}
    assert len(second) == 4
    for before in first:
        after = second[(before.group_id, before.sample_index)]
        k = len(before.token_ids)
        assert after.finish_reason == "length" and len(after.token_ids) == 12
        # the prefix is kept as it was
        assert after.token_ids[:k] == before.token_ids and after.logprobs[:k] == before.logprobs
        assert after.token_policy_versions == [0] * k + [1] * (12 - k)  # versions change at the stop position
        assert after.started_at == before.started_at and after.gen_s >= before.gen_s
        # Each token's behaviour logprob is the one its version gives it, teacher-forced over the whole sample.
        old, new = (_teacher_forced(m, after, 1.0, tok.eos_token_id) for m in (model, newer))
        got = torch.tensor(after.logprobs)
        assert torch.allclose(got[:k], old[:k], atol=1e-4) and torch.allclose(got[k:], new[k:], atol=1e-4)
        if k:
            assert not torch.allclose(got[k:], old[k:], atol=1e-2)  # the new weights did sample the suffix


def test_a_resumed_sample_is_reproducible_and_equals_an_uninterrupted_one_under_the_same_weights(policy, kv):
    model, tok = policy
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=21)
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=64, kv_cache=kv)
    requests = _requests(tok, 3, params)
    whole = {(s.group_id, s.sample_index): s for s in engine.generate(requests)}
    steps = 0

    def stop_after_three() -> bool:
        nonlocal steps
        steps += 1
        return steps > 3

    parts = list(engine.generate(requests, stop_after_three))
    finished = {(s.group_id, s.sample_index): s for s in parts if not s.partial}
    partial = [s for s in parts if s.partial]
    assert partial and all(len(s.token_ids) == 3 for s in partial)
    resume = [
        GroupRequest(
            r.group_id, r.prompt_token_ids, r.n, r.sampling, tuple(s for s in partial if s.group_id == r.group_id)
        )
        for r in requests
        if any(s.group_id == r.group_id for s in partial)
    ]
    for _ in range(2):  # twice: the continuation is a function of (sample seed, position), nothing else
        done = {**finished, **{(s.group_id, s.sample_index): s for s in engine.generate(resume)}}
        assert {k: s.token_ids for k, s in done.items()} == {k: s.token_ids for k, s in whole.items()}
        for k, s in done.items():
            assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(whole[k].logprobs), atol=1e-5)


def test_resume_rejects_samples_that_are_not_this_groups_partial_ones(policy, kv):
    model, tok = policy
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, kv_cache=kv)
    params = SamplingParams(max_tokens=4, seed=1)
    done = next(iter(engine.generate(_requests(tok, 1, params)[:1])))
    with pytest.raises(ValueError, match="only this group's partial samples"):
        list(engine.generate([GroupRequest("g0", done.prompt_token_ids, 1, params, (done,))]))


def test_a_group_prefills_its_prompt_once(policy, kv):
    """The n samples of a fresh group share one prompt row in the prefill, and still sample as if each
    had its own (same tokens and logprobs as groups of one sample seeded alike)."""
    model, tok = policy
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=64, kv_cache=kv)
    prefill_rows = []
    hook = model.model.embed_tokens.register_forward_pre_hook(  # a prefill embeds [rows, width > 1]
        lambda _m, args: prefill_rows.append(args[0].shape[0]) if args[0].dim() == 2 and args[0].shape[1] > 1 else None
    )
    try:
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=5)
        shared = {
            (s.group_id, s.sample_index): (s.token_ids, s.logprobs) for s in engine.generate(_requests(tok, 4, params))
        }
    finally:
        hook.remove()
    assert prefill_rows == [len(PROMPTS)]  # one row per prompt, not per sample
    assert len(shared) == len(PROMPTS) * 4
    # each sample prefilled alone
    lone = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=1, kv_cache=kv)
    alone = {(s.group_id, s.sample_index): (s.token_ids, s.logprobs) for s in lone.generate(_requests(tok, 4, params))}
    for key, (tokens, logprobs) in alone.items():
        assert shared[key][0] == tokens
        assert torch.allclose(torch.tensor(shared[key][1]), torch.tensor(logprobs), atol=1e-5)


# -- the two KV caches --------------------------------------------------------------------------------


def _samples(engine, requests):
    return {(s.group_id, s.sample_index): s for s in engine.generate(requests)}


def _same_samples(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, s in a.items():
        assert s.token_ids == b[key].token_ids, key
        assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(b[key].logprobs), atol=1e-4), key


def test_slot_and_padded_caches_sample_the_same_tokens_with_the_same_logprobs(policy):
    """Rows join and leave at different steps (max_batch 5 < 20 samples, eos ends them unevenly), so
    slots are reused and moved; the padded cache is transformers' own forward, the reference."""
    model, tok = policy
    requests = _requests(tok, 4, SamplingParams(temperature=1.0, max_tokens=12, seed=13))
    runs = [
        _samples(EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=5, kv_cache=kv), requests)
        for kv in ("slots", "padded")
    ]
    assert len({len(s.token_ids) for s in runs[0].values()}) > 1  # lengths differ: rows left mid-batch
    _same_samples(*runs)


def test_slot_cache_serves_a_qwen2_model_as_transformers_does():
    """Grouped-query heads and biased q/k/v projections (Qwen2) through the slot cache."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from models.builtin.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(3)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # random biases: zero ones would not test that they are applied
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    requests = _requests(tok, 3, SamplingParams(temperature=1.0, max_tokens=8, seed=2))
    slots = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=4)
    assert slots.kv_cache == "slots"
    padded = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=4, kv_cache="padded")
    _same_samples(_samples(slots, requests), _samples(padded, requests))


def test_other_architectures_fall_back_to_the_padded_cache_and_say_why_slots_do_not_apply():
    from transformers import GPT2Config, GPT2LMHeadModel

    from models.builtin.tokenizer import build_char_tokenizer
    from models.engines.kv_cache import slot_cache_applies

    tok = build_char_tokenizer()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert "gpt2" in slot_cache_applies(model, 8, 64)
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id)
    assert engine.kv_cache == "padded"
    samples = list(engine.generate(_requests(tok, 2, SamplingParams(temperature=1.0, max_tokens=4, seed=1))))
    assert len(samples) == len(PROMPTS) * 2
    with pytest.raises(ValueError, match="cannot serve this model: model type 'gpt2'"):
        EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, kv_cache="slots")


def test_the_slot_cache_stays_within_its_memory_budget(policy):
    from models.engines.kv_cache import SLOT_BUDGET_BYTES, slot_bytes, slot_cache_applies

    model, _ = policy
    assert slot_cache_applies(model, 1024, 64) is None
    too_many = SLOT_BUDGET_BYTES // slot_bytes(model, 1, 64) + 1
    assert "GiB of cache" in slot_cache_applies(model, too_many, 64)
