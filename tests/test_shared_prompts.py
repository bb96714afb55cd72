"""Scoring completions over shared prompts: the trainer encodes each group's prompt once.

``completion_logprobs`` must give the numbers (and gradients) of scoring every full sequence
(``token_logprobs``), for prompts of different lengths, ragged completions, temperature and nucleus
sampling, since the PPO ratio and the mismatch figure compare it with the engine's logprobs.
"""

from __future__ import annotations

import pytest


def test_right_padded_places_each_rows_values_first():
    from models.logprobs import right_padded

    out = right_padded([[1.5, 2.5], [], [3.0]], 3, fill=-1.0)
    assert out.tolist() == [[1.5, 2.5, -1.0], [-1.0, -1.0, -1.0], [3.0, -1.0, -1.0]]
    ids = right_padded([[4, 5], [6]], 2, fill=0, integer=True)
    assert ids.dtype.is_floating_point is False and ids.tolist() == [[4, 5], [6, 0]]


def test_pack_shared_keeps_one_row_per_distinct_prompt():
    from models.logprobs import pack_shared

    prompts = [[1, 7, 8], [1, 7, 8], [1, 9], [1, 7, 8]]
    completions = [[3], [4, 5], [6, 2, 2], []]
    b = pack_shared(prompts, completions, pad_token_id=0)
    assert b.prompt_ids.tolist() == [[1, 7, 8], [0, 1, 9]]  # left-padded, in order of first sight
    assert b.prompt_mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert b.owner.tolist() == [0, 0, 1, 0]
    assert b.completion_ids.tolist() == [[3, 0, 0], [4, 5, 0], [6, 2, 2], [0, 0, 0]]
    assert b.completion_mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]]


def test_length_chunks_split_off_long_rows_only_when_padding_them_costs_more_than_the_budget():
    import torch

    from models.logprobs import length_chunks

    lengths = torch.tensor([4, 3, 8, 3, 4, 3, 1])
    chunks = length_chunks(lengths, padding_budget=2)
    assert [lengths[c].tolist() for c in chunks] == [[1, 3, 3, 3], [4, 4], [8]]
    assert sorted(torch.cat(chunks).tolist()) == list(range(7))  # every row once
    assert [c.tolist() for c in length_chunks(lengths, padding_budget=100)] == [[6, 1, 3, 5, 0, 4, 2]]
    assert len(length_chunks(lengths, padding_budget=0)) == 4  # one chunk per distinct length
    assert length_chunks(torch.tensor([], dtype=torch.long)) == []


@pytest.mark.parametrize(
    "temperature,top_p,padding_budget", [(1.0, 1.0, 64), (0.7, 1.0, 64), (1.0, 0.8, 64), (1.0, 1.0, 0), (0.7, 0.8, 0)]
)
def test_shared_scoring_matches_full_sequences(tiny_policy_dir, temperature, top_p, padding_budget):
    import torch

    from models.checkpoint import load_policy
    from models.logprobs import completion_logprobs, pack_sequences, pack_shared, token_logprobs

    model, tokenizer = load_policy(tiny_policy_dir)
    torch.manual_seed(1)
    bos = tokenizer.bos_token_id
    group_prompts = [[bos, 3, 4, 13], [bos, 5, 13], [bos, 6, 7, 8, 13]]  # three lengths: left padding differs
    prompts, completions = [], []
    for prompt in group_prompts:
        for _ in range(4):
            prompts.append(prompt)
            completions.append(torch.randint(3, 12, (int(torch.randint(1, 6, ())),)).tolist())
    completions[-1] = completions[-1] + [5] * 6  # one long row: with budget 0 every length runs as its own chunk
    nucleus = torch.full((len(prompts),), top_p)

    full = pack_sequences(prompts, completions, tokenizer.pad_token_id)
    shared = pack_shared(prompts, completions, tokenizer.pad_token_id)
    assert shared.prompt_ids.shape[0] == 3
    width = shared.completion_ids.shape[1]
    start = full.input_ids.shape[1] - width - 1  # where token_logprobs reports the first completion token
    reference = token_logprobs(model, full, temperature, nucleus)[:, start:]  # [B, C]
    scored = completion_logprobs(model, shared, temperature, nucleus, padding_budget)  # [B, C]
    mask = shared.completion_mask.bool()
    assert torch.equal(mask, full.completion_mask[:, start:].bool())
    assert torch.allclose(scored[mask], reference[mask], atol=1e-5)

    grads = [torch.autograd.grad((x * mask).sum(), list(model.parameters())) for x in (reference, scored)]
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
