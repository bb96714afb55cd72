"""``train.credit: prefix``: per-token advantages from the prefixes a group's samples share, by hand; how they reach
minibatches, micro-batches and workers' shares; and that the loss and the update take them per token (the update
on hand-made minibatches of a tiny policy, on CPU, as tests/test_policy_update.py does)."""

import pytest


def test_prefix_credit_by_hand():
    """Samples 85, 84, 95, 75 of one group (85 right): the tens digit earns the 8-branch's mean over the group's
    mean, the units digit its change within the 8-branch, and the units of 95 and 75, the only samples on their
    branches, nothing: their tens digit was the mistake."""
    from tasks.train.minibatches import prefix_credit

    eos = 0
    a = [1.5, -0.5, -0.5, -0.5]
    credits = prefix_credit([[8, 5, eos], [8, 4, eos], [9, 5, eos], [7, 5, eos]], a)
    assert credits == [
        [pytest.approx(0.5), pytest.approx(1.0), 0.0],
        [pytest.approx(0.5), pytest.approx(-1.0), 0.0],
        [-0.5, 0.0, 0.0],
        [-0.5, 0.0, 0.0],
    ]
    # each sample's credits add up to its advantage (every completion here is its own)
    assert [sum(c) for c in credits] == pytest.approx(a)
    # a token every sample agrees on carries nothing; identical samples share their (mean) advantage
    assert prefix_credit([[1, 2], [1, 2], [1, 3], [1, 3]], [0.5, 0.5, -0.5, -0.5]) == [
        [0.0, 0.5],
        [0.0, 0.5],
        [0.0, -0.5],
        [0.0, -0.5],
    ]
    # samples of other lengths: a shorter sample leaves the shared prefix where it ends
    assert prefix_credit([[4], [4, 5]], [1.0, -1.0]) == [[0.0], [0.0, -1.0]]


def test_summed_over_a_group_the_first_token_gets_grpos_gradient():
    """At the first token, where every sample's prefix is the empty one, the credits of the samples choosing each
    token add up to the sum of their advantages: GRPO's gradient there, unchanged."""
    import random

    from tasks.train.minibatches import prefix_credit

    rng = random.Random(0)
    for _ in range(50):
        completions = [[rng.randrange(3) for _ in range(rng.randrange(1, 5))] for _ in range(rng.randrange(2, 9))]
        rewards = [float(rng.random() < 0.5) for _ in completions]
        mean = sum(rewards) / len(rewards)
        advantages = [r - mean for r in rewards]
        credits = prefix_credit(completions, advantages)
        for token in {c[0] for c in completions}:
            chose = [i for i, c in enumerate(completions) if c[0] == token]
            assert sum(credits[i][0] for i in chose) == pytest.approx(sum(advantages[i] for i in chose))


def rows_of_two_groups() -> list[dict]:
    """Kept rows of groups a and b, their samples interleaved as a round may store them."""

    def row(group, completion, advantage):
        return {
            "group_id": group,
            "prompt_token_ids": [1, 3 if group == "a" else 4],
            "completion_token_ids": completion,
            "rollout_logprobs": [0.0] * len(completion),
            "advantage": advantage,
            "token_policy_versions": [0] * len(completion),
            "sampling": {"top_p": 1.0, "max_tokens": 4},
        }

    return [
        row("a", [5, 6], 1.0),
        row("b", [5, 6], 1.0),
        row("a", [5, 7], -1.0),
        row("b", [8, 6], -1.0),
    ]


def test_minibatches_micro_batches_and_shares_carry_each_rows_credits():
    """Credits are computed within each group (not across groups that share tokens), follow their rows into
    micro-batches and workers' shares, and are absent under the default."""
    from tasks.config.train import TrainConfig
    from tasks.train.minibatches import microbatches, minibatches, sharded_minibatches

    rows = rows_of_two_groups()
    assert minibatches(rows, 2, 1)[0].token_advantages is None  # 'sample', the default
    (batch,) = minibatches(rows, 2, 1, credit="prefix")
    by_completion = {
        (p[1], tuple(c)): t for p, c, t in zip(batch.prompt_ids, batch.completion_ids, batch.token_advantages)
    }
    assert by_completion == {
        (3, (5, 6)): [0.0, 1.0],  # group a agrees on 5, parts at the second token
        (3, (5, 7)): [0.0, -1.0],
        (4, (5, 6)): [1.0, 0.0],  # group b parts at the first token
        (4, (8, 6)): [-1.0, 0.0],
    }
    parts = microbatches(batch, TrainConfig(max_tokens_per_microbatch=8))
    assert len(parts) == 2 and sum((p.token_advantages for p in parts), []) == batch.token_advantages
    shares = sharded_minibatches(rows, 2, 1, None, 2, credit="prefix")
    assert [s[0].token_advantages for s in shares] == [[[0.0, 1.0], [0.0, -1.0]], [[1.0, 0.0], [-1.0, 0.0]]]


def test_the_loss_takes_per_token_advantages():
    """[B, T] advantages equal to each row's advantage on every token give the loss of [B] advantages exactly;
    a token's own advantage moves only its own term."""
    import torch

    from models.loss import LossInputs, LossSettings, policy_loss

    torch.manual_seed(0)
    logp = torch.randn(3, 4, requires_grad=True)
    common = dict(logprobs=logp, behaviour_logprobs=logp.detach() + 0.1 * torch.randn(3, 4), mask=torch.ones(3, 4))
    per_sample = torch.tensor([1.0, -0.5, 0.25])
    settings = LossSettings(clip_high=0.28)
    a = policy_loss(LossInputs(advantages=per_sample, **common), settings)
    b = policy_loss(LossInputs(advantages=per_sample.unsqueeze(-1).expand(3, 4).clone(), **common), settings)
    assert torch.equal(a.loss, b.loss) and a.clip_fraction == b.clip_fraction
    (grad,) = torch.autograd.grad(policy_loss(LossInputs(advantages=torch.eye(3, 4), **common), settings).loss, logp)
    assert (grad != 0).tolist() == torch.eye(3, 4).bool().tolist()


def test_an_update_under_prefix_credit_leaves_agreed_tokens_alone(tiny_policy_dir):
    """One optimizer step on a group whose two samples share their first token: under 'prefix' that token's
    credit is zero, so the step is the step of a batch whose first-token advantages are zero, and it differs from
    the step under 'sample'."""
    import copy
    import dataclasses

    import torch

    from models.checkpoint import load_policy
    from tasks.config.train import TrainConfig
    from tasks.train.minibatches import minibatches
    from tasks.train.policy_update import train_policy

    model, tokenizer = load_policy(tiny_policy_dir)
    prompt = [tokenizer.bos_token_id, 3, 4, 13]
    rows = [
        {
            "group_id": "g",
            "prompt_token_ids": prompt,
            "completion_token_ids": completion,
            "rollout_logprobs": [-2.0] * 3,
            "advantage": advantage,
            "token_policy_versions": [0] * 3,
            "sampling": {"top_p": 1.0, "max_tokens": 3},
        }
        for completion, advantage in (([5, 6, 7], 1.0), ([5, 9, 2], -1.0))
    ]
    config = TrainConfig(epochs=1, max_kl=None, warmup_steps=0)
    common = dict(temperature=1.0, current_version=0, recompute=True)

    def stepped(batches):
        trained = copy.deepcopy(model)
        train_policy(trained, tokenizer.pad_token_id, batches, config=config, optimizer=None, **common)
        return [p.detach().clone() for p in trained.parameters()]

    (prefix,) = minibatches(rows, 1, 1, credit="prefix")
    assert prefix.token_advantages == [[0.0, 1.0, 0.0], [0.0, -1.0, 0.0]]
    (sample,) = minibatches(rows, 1, 1)
    by_hand = dataclasses.replace(sample, token_advantages=[[0.0, 1.0, 0.0], [0.0, -1.0, 0.0]])
    assert all(torch.equal(p, q) for p, q in zip(stepped([prefix]), stepped([by_hand])))
    assert any(not torch.equal(p, q) for p, q in zip(stepped([prefix]), stepped([sample])))
