"""The embedded engine's KV caches (models/engines/kv_cache.py) side by side: the slot cache against transformers'
own, attention cut into runs against one pass, rows sorted at refill, prefills in chunks of similar length."""

import pytest
import torch

from models.checkpoint import load_policy

PROMPTS = ["1+2=", "34+56=", "7+89=", "99+99=", "5+5="]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_slot_and_padded_caches_give_the_same_logits_at_each_precision(tiny_policy_dir, dtype, tolerance):
    """The caches side by side: one prefill of inputs of different lengths, then decode steps with rows
    leaving between them. In bfloat16 they agree to its rounding."""
    from models.engines.kv_cache import PaddedCache, SlotCache, distinct_inputs

    model, tok = load_policy(tiny_policy_dir, dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    inputs, owner = distinct_inputs([tuple(tok(p)["input_ids"]) for p in PROMPTS for _ in range(2)])
    slots, padded = SlotCache(model, 16, tok.pad_token_id), PaddedCache(model, tok.pad_token_id)
    with torch.inference_mode():
        got = [cache.admit(inputs, owner, 16) for cache in (slots, padded)]
        assert torch.allclose(got[0], got[1], atol=tolerance)
        rows = list(range(len(owner)))
        for step in range(4):
            tokens = torch.tensor([3 + (row + step) % 10 for row in rows])
            got = [slots.step(tokens), padded.step(tokens)]
            assert torch.allclose(got[0], got[1], atol=tolerance), step
            keep = [i for i in range(len(rows)) if (i + step) % 3]  # a third of the rows leave each step
            order = slots.retire(keep)  # the slot cache moves rows; the padded one keeps the order it is given
            assert sorted(order) == keep and padded.retire(order) == order
            rows = [rows[i] for i in order]


def test_attention_runs_give_long_rows_their_own_run_and_cut_only_where_it_saves(monkeypatch):
    from models.engines import kv_cache
    from models.engines.kv_cache import ATTEND_BLOCK_ROWS, attention_runs

    block = ATTEND_BLOCK_ROWS
    tail = torch.tensor([100] * block + [4] * (5 * block))  # run-ons at their 101st key, the rest at the 5th
    assert attention_runs(tail) == [(0, block, 101), (block, 6 * block, 5)]
    even = torch.tensor([6] * (3 * block) + [4] * (3 * block))  # lengths too close for a cut to pay
    assert attention_runs(even) == [(0, 6 * block, 7)]
    assert attention_runs(torch.tensor([4] * (block - 1) + [100])) == [(0, block, 101)]  # one block: one run
    # out of order (a long row admitted after short ones): its block alone pays for its length
    late = torch.tensor([4] * (4 * block) + [100] + [4] * (block - 1) + [4] * (2 * block))
    assert attention_runs(late) == [(0, 4 * block, 5), (4 * block, 5 * block, 101), (5 * block, 7 * block, 5)]
    # every row is in exactly one run, which holds its keys, at any block size
    monkeypatch.setattr(kv_cache, "ATTEND_BLOCK_ROWS", 3)
    lengths = torch.tensor([(37 * i) % 90 for i in range(50)])
    runs = attention_runs(lengths)
    assert [r[0] for r in runs] == [0] + [r[1] for r in runs[:-1]] and runs[-1][1] == 50
    assert all(keys == int(lengths[a:b].max()) + 1 for a, b, keys in runs)


def test_rows_attending_in_runs_get_the_logits_of_one_pass(tiny_policy_dir, monkeypatch):
    """A batch of a few long rows and many short ones (a long tail), longest first as the engine admits
    them: the slot cache's attention in runs gives what one pass over every row's whole span gives, and
    what transformers' cache gives, also after rows leave and the last rows fill their slots."""
    from models.engines import kv_cache
    from models.engines.kv_cache import PaddedCache, SlotCache, attention_runs, distinct_inputs

    model, tok = load_policy(tiny_policy_dir)
    prompt = tuple(tok(PROMPTS[1])["input_ids"])
    inputs = [prompt + tuple(tok("123456789")["input_ids"][1:]) * 4] * 4 + [prompt] * 36  # 4 rows 36 keys longer
    distinct, owner = distinct_inputs(inputs)
    monkeypatch.setattr(kv_cache, "ATTEND_BLOCK_ROWS", 4)
    one_pass = SlotCache(model, 48, tok.pad_token_id)
    runs, padded = SlotCache(model, 48, tok.pad_token_id), PaddedCache(model, tok.pad_token_id)
    with torch.inference_mode():
        for cache in (one_pass, runs, padded):
            cache.admit(distinct, owner, 60)
        cut = attention_runs(runs.lengths[:40])
        assert cut[0][:2] == (0, 4) and len(cut) > 1 and max(keys for _, _, keys in cut[1:]) < 12
        rows = list(range(40))
        for step in range(4):
            tokens = torch.tensor([3 + (row + step) % 10 for row in rows])
            got_runs, got_padded = runs.step(tokens), padded.step(tokens)
            monkeypatch.setattr(kv_cache, "ATTEND_BLOCK_ROWS", 10**9)
            got_one = one_pass.step(tokens)
            monkeypatch.setattr(kv_cache, "ATTEND_BLOCK_ROWS", 4)
            assert torch.allclose(got_runs, got_one, atol=1e-6), step
            assert torch.allclose(got_runs, got_padded, atol=1e-5), step
            keep = [i for i in range(len(rows)) if i % 7 != step]  # a long row leaves: a short one takes its slot
            order = runs.retire(keep)
            assert one_pass.retire(keep) == order and padded.retire(order) == order
            rows = [rows[i] for i in order]


def test_rows_sorted_longest_first_keep_their_keys_and_logits(tiny_policy_dir, monkeypatch):
    """Rows out of order (short ones took the slots of long ones): ``sort_rows`` moves them longest first
    where the keys saved pay for the copy, and every row decodes on as it would have unmoved."""
    from models.engines import kv_cache
    from models.engines.kv_cache import PaddedCache, SlotCache, attention_runs, distinct_inputs, run_keys

    model, tok = load_policy(tiny_policy_dir)
    prompt = tuple(tok(PROMPTS[1])["input_ids"])
    long = prompt + tuple(tok("123456789")["input_ids"][1:]) * 4
    inputs = [prompt, long] * 20  # long and short rows interleaved
    distinct, owner = distinct_inputs(inputs)
    monkeypatch.setattr(kv_cache, "ATTEND_BLOCK_ROWS", 4)  # a batch this small cut as a large one is
    monkeypatch.setattr(kv_cache, "RUN_OVERHEAD_KEYS", 16)
    moved, unmoved = SlotCache(model, 48, tok.pad_token_id), SlotCache(model, 48, tok.pad_token_id)
    with torch.inference_mode():
        for cache in (moved, unmoved):
            cache.admit(distinct, owner, 60)
        before = run_keys(attention_runs(moved.lengths[:40]))
        order = moved.sort_rows()
        assert sorted(order) == list(range(40)) and order[:20] == list(range(1, 40, 2))  # the long rows first
        assert run_keys(attention_runs(moved.lengths[:40])) < 0.6 * before  # 20 x 44 + 20 x 8 against 40 x 44
        assert moved.lengths[:40].tolist() == unmoved.lengths[:40][order].tolist()
        assert moved.sort_rows() is None  # in order: nothing to gain
        for step in range(3):
            tokens = torch.tensor([3 + (row + step) % 10 for row in range(40)])
            assert torch.allclose(moved.step(tokens[order]), unmoved.step(tokens)[order], atol=1e-6), step
        assert PaddedCache(model, tok.pad_token_id).sort_rows() is None


def test_inputs_of_many_lengths_prefill_in_chunks_with_the_logits_of_one_padded_prefill(tiny_policy_dir, monkeypatch):
    """Resumed samples join with prefixes of every length: the slot cache prefills them in chunks of
    similar length, each row's keys and values land in its own slot (the decode steps after agree), and
    the logits are those of one prefill padded to the longest, and transformers' cache's."""
    from models.engines import kv_cache
    from models.engines.kv_cache import PaddedCache, SlotCache, distinct_inputs
    from models.logprobs import length_chunks

    model, tok = load_policy(tiny_policy_dir)
    prompt = tuple(tok(PROMPTS[0])["input_ids"])
    digits = tuple(tok("1234567890")["input_ids"][1:])
    # long and short prefixes interleaved, a few shared: rows and chunks are in different orders
    inputs = [prompt + (digits * 8)[: (17 * row) % 70] for row in range(30)] + [prompt] * 3
    distinct, owner = distinct_inputs(inputs)
    monkeypatch.setattr(kv_cache, "PREFILL_PADDING_BUDGET", 32)
    assert len(length_chunks(torch.tensor([len(x) for x in distinct]), 32)) > 3
    chunked = SlotCache(model, 40, tok.pad_token_id)
    one, padded = SlotCache(model, 40, tok.pad_token_id), PaddedCache(model, tok.pad_token_id)
    with torch.inference_mode():
        got_chunked = chunked.admit(distinct, owner, 100)
        monkeypatch.setattr(kv_cache, "PREFILL_PADDING_BUDGET", 10**9)
        got_one, got_padded = one.admit(distinct, owner, 100), padded.admit(distinct, owner, 100)
        assert torch.allclose(got_chunked, got_one, atol=1e-5) and torch.allclose(got_chunked, got_padded, atol=1e-5)
        assert chunked.lengths[: len(owner)].tolist() == [len(x) for x in inputs]
        for step in range(3):
            tokens = torch.tensor([3 + (row + step) % 10 for row in range(len(owner))])
            got = [cache.step(tokens) for cache in (chunked, one, padded)]
            assert torch.allclose(got[0], got[1], atol=1e-5) and torch.allclose(got[0], got[2], atol=1e-5), step
