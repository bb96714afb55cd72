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


def train_once(parent: str, rows: list[dict], **train) -> tuple[dict, dict]:
    """One round's update of ``rows`` in this process from ``parent``: (stats, the new weights)."""
    from models.checkpoint import load_policy
    from tasks.config.train import TrainConfig
    from tasks.train.policy_update import minibatches, train_policy

    config = TrainConfig(
        **{"groups_per_step": 2, "steps_per_round": 3, "epochs": 1, "max_kl": None, "learning_rate": 1e-3, **train}
    )
    model, tokenizer = load_policy(parent)
    batches = minibatches(rows, config.groups_per_step, config.steps_per_round)
    _, stats = train_policy(
        model,
        tokenizer.pad_token_id,
        batches,
        config=config,
        temperature=1.0,
        optimizer=None,
        current_version=0,
        recompute=[True] * len(batches),
    )
    return stats, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_close_weights(a: dict, b: dict, atol: float) -> None:
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < atol, f"weights {worst:.2e} apart (max abs)"


@pytest.mark.parametrize("aggregation", ["token", "sequence", "dr_grpo"])
def test_micro_batches_make_the_unsplit_update(tiny_policy_dir, aggregation):
    """Minibatches of up to 8 samples split into micro-batches of at most 30 padded tokens (2 to 5 each)
    accumulate to the unsplit update: weights within 1e-5 after three Adam steps (the bound the worker group
    meets), the same loss and figures."""
    from models.checkpoint import load_policy
    from tasks.config.train import TrainConfig
    from tasks.train.policy_update import microbatches, minibatches
    from tests.test_sharded_training import synthetic_rows

    rows = synthetic_rows(load_policy(tiny_policy_dir)[1])
    config = TrainConfig(groups_per_step=2, steps_per_round=3, max_tokens_per_microbatch=30)
    parts = [microbatches(b, config) for b in minibatches(rows, 2, 3)]
    assert [len(p) for p in parts] == [5, 4, 2]  # the last minibatch holds one group
    assert all(sum(len(m.advantages) for m in p) == len(b.advantages) for p, b in zip(parts, minibatches(rows, 2, 3)))

    whole, whole_weights = train_once(tiny_policy_dir, rows, aggregation=aggregation)
    split, split_weights = train_once(tiny_policy_dir, rows, aggregation=aggregation, max_tokens_per_microbatch=30)
    assert_close_weights(whole_weights, split_weights, 1e-5)
    for key in ("train/loss", "train/clip_fraction", "train/grad_norm", "train/mismatch_mean_abs", "train/drift_kl"):
        assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    assert split["train/samples"] == whole["train/samples"] and split["train/steps"] == whole["train/steps"] == 3


def test_checkpointed_layers_give_the_gradients_of_kept_activations():
    """Recomputing the decoder layers in the backward pass gives every parameter's gradient of keeping their
    activations (sequence scoring both ways), and the layers' children stay in eval mode (no dropout)."""
    from models.logprobs import sequence_logprobs
    from models.memory import checkpoint_layers, checkpointed

    batch = shared_batch(3000)
    mask = batch.completion_mask.bool()
    grads = []
    for on in (False, True):
        model = qwen_shaped(3000)
        model.config.attention_dropout = 0.5  # would change every number if it ran
        if on:
            assert checkpoint_layers(model) == 2 and checkpointed(model)
            assert not any(m.training for layer in model.model.layers for m in layer.children())
        scores = sequence_logprobs(model, batch, 1.0)
        grads.append(torch.autograd.grad((scores * mask).sum(), list(model.parameters())))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_a_checkpointed_round_makes_the_update_of_a_plain_one(tiny_policy_dir):
    """train.gradient_checkpointing (with micro-batches too) lands within 1e-5 of the plain update."""
    from models.checkpoint import load_policy
    from tests.test_sharded_training import synthetic_rows

    rows = synthetic_rows(load_policy(tiny_policy_dir)[1])
    plain, plain_weights = train_once(tiny_policy_dir, rows)
    for extra in ({}, {"max_tokens_per_microbatch": 30}):
        stats, weights = train_once(tiny_policy_dir, rows, gradient_checkpointing=True, **extra)
        assert_close_weights(plain_weights, weights, 1e-5)
        assert stats["train/loss"] == pytest.approx(plain["train/loss"], rel=1e-5, abs=1e-7)


def test_two_workers_with_micro_batches_make_the_one_process_update(tiny_policy_dir, tmp_path):
    """Two gloo workers whose shares split into different numbers of micro-batches (the one holding the long
    answers more: the other pads with stand-ins) land within 1e-5 of one unsplit process."""
    from models.checkpoint import load_policy
    from tests.test_sharded_training import one_process, step_config, synthetic_rows, two_workers, weight_gap

    rows = synthetic_rows(load_policy(tiny_policy_dir)[1])
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    stats, _ = one_process(tiny_policy_dir, rows, step_config(), one)
    results = two_workers(
        tiny_policy_dir, rows, step_config(max_tokens_per_microbatch=30, gradient_checkpointing=True), two
    )
    worst, _ = weight_gap(one, two)
    assert worst < 1e-5, f"2 workers with micro-batches moved the weights {worst:.2e} from one process's update"
    for key in ("train/loss", "train/grad_norm", "train/drift_kl"):
        assert results[0].stats[key] == pytest.approx(stats[key], rel=1e-4, abs=1e-6), key
