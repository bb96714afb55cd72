"""Scoring and training in bounded memory: the output head run a slice of positions at a time, token-budget
micro-batches, activation checkpointing.

Each must compute what the unbounded path computes (to float rounding, gradients included), since the PPO
ratio, the mismatch figure and the update compare and combine these numbers; and a budget the built-in
policies fit within must leave their computation as it was.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def qwen_shaped(vocab: int = 3000, tied: bool = True, seed: int = 0):
    """A random two-layer Qwen2 with a vocabulary much wider than the built-in one, tied embeddings as
    Qwen2.5-0.5B has them."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    return Qwen2ForCausalLM(config).eval()


def shared_batch(vocab: int, seed: int = 1):
    """Three groups of four samples, prompts of three lengths, ragged completions (one long)."""
    from models.logprobs import pack_shared

    generator = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for length in (3, 5, 2):
        prompt = torch.randint(3, vocab, (length,), generator=generator).tolist()
        for _ in range(4):
            prompts.append(prompt)
            size = int(torch.randint(1, 7, (), generator=generator))
            completions.append(torch.randint(3, vocab, (size,), generator=generator).tolist())
    completions[-1] += [7] * 6
    return pack_shared(prompts, completions, pad_token_id=0)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
@pytest.mark.parametrize("padding_budget", [64, None])
def test_chunked_head_scores_as_the_whole_logits_do(temperature, top_p, padding_budget):
    """A budget of a few positions' logits (the prompt pass then keeps only its last position, the
    completions go through the head 2 positions at a time) gives the values within 1e-6 and the gradients
    of every parameter within float rounding of the whole logits."""
    from models.logprobs import completion_logprobs

    vocab = 3000
    model, batch = qwen_shaped(vocab), shared_batch(vocab)
    nucleus = torch.full((batch.owner.shape[0],), top_p)
    mask = batch.completion_mask.bool()
    whole = completion_logprobs(model, batch, temperature, nucleus, padding_budget)
    bounded = completion_logprobs(model, batch, temperature, nucleus, padding_budget, logits_budget=2 * vocab)
    assert torch.allclose(bounded[mask], whole[mask], atol=1e-6, rtol=0)
    assert bool((bounded[~mask] == 0).all()), "positions past a completion are not scored"
    grads = [torch.autograd.grad((x * mask).sum(), list(model.parameters())) for x in (whole, bounded)]
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("budget", [None, 2 * 3000])
def test_sequence_scoring_matches_shared_prompt_scoring(budget):
    """Scoring each sample's whole sequence without a cache (what activation checkpointing needs) gives the
    shared-prompt numbers and gradients, whole or through the sliced head."""
    from models.logprobs import LOGITS_BUDGET, completion_logprobs, sequence_logprobs

    vocab = 3000
    model, batch = qwen_shaped(vocab), shared_batch(vocab)
    nucleus = torch.full((batch.owner.shape[0],), 0.9)
    mask = batch.completion_mask.bool()
    shared = completion_logprobs(model, batch, 0.8, nucleus)
    sequence = sequence_logprobs(model, batch, 0.8, nucleus, logits_budget=budget or LOGITS_BUDGET)
    assert torch.allclose(sequence[mask], shared[mask], atol=1e-5)
    grads = [torch.autograd.grad((x * mask).sum(), list(model.parameters())) for x in (shared, sequence)]
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_a_head_with_a_logit_transform_is_scored_whole():
    """A model whose logits are soft-capped after the head is never run through the bare head."""
    from models.logprobs import plain_head

    model = qwen_shaped(50)
    assert plain_head(model)
    model.config.final_logit_softcapping = 30.0
    assert not plain_head(model)
