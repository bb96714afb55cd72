"""The policy loss against values computed by hand."""

import math

import pytest
import torch

from models.loss import LossInputs, LossSettings, aggregate, logprob_mismatch, policy_loss


def _inputs(logp, behaviour, adv, mask, proximal=None):
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    return LossInputs(
        logprobs=t(logp),
        behaviour_logprobs=t(behaviour),
        advantages=t(adv),
        mask=t(mask),
        proximal_logprobs=None if proximal is None else t(proximal),
    )


def test_on_policy_loss_is_minus_mean_advantage():
    # ratio 1 everywhere: per-token loss = -A; token mean over 3 real tokens: -(2*1 + 1*(-0.5))/3 = -0.5
    x = _inputs([[-1.0, -2.0], [-0.5, 0.0]], [[-1.0, -2.0], [-0.5, 0.0]], [1.0, -0.5], [[1, 1], [1, 0]])
    out = policy_loss(x, LossSettings())
    assert float(out.loss) == pytest.approx(-0.5)
    assert out.clip_fraction == 0.0 and out.ratio_mean == pytest.approx(1.0)


def test_ratio_is_clipped_in_the_direction_of_the_advantage():
    # ratio e^0.5 = 1.6487 > 1.2 with A = +1: min(1.6487, 1.2) = 1.2 -> loss -1.2, clipped
    x = _inputs([[-0.5]], [[-1.0]], [1.0], [[1]])
    out = policy_loss(x, LossSettings(clip_low=0.2, clip_high=0.2))
    assert float(out.loss) == pytest.approx(-1.2)
    assert out.clip_fraction == 1.0
    # with A = -1 the unclipped term is the minimum: min(-1.6487, -1.2) = -1.6487 -> loss +1.6487
    x = _inputs([[-0.5]], [[-1.0]], [-1.0], [[1]])
    out = policy_loss(x, LossSettings())
    assert float(out.loss) == pytest.approx(math.exp(0.5), rel=1e-5)
    assert out.clip_fraction == 0.0


def test_truncated_importance_weight_corrects_engine_mismatch():
    # proximal (trainer) -1.0, engine -2.0: weight e^1 = 2.718 truncated at cap 2.0; ratio vs proximal = 1
    x = _inputs([[-1.0]], [[-2.0]], [1.0], [[1]], proximal=[[-1.0]])
    out = policy_loss(x, LossSettings(tis_cap=2.0))
    assert float(out.loss) == pytest.approx(-2.0)
    assert out.tis_mean == pytest.approx(2.0) and out.tis_truncated_fraction == 1.0
    # below the cap the weight is the plain ratio e^-0.5
    x = _inputs([[-1.0]], [[-0.5]], [1.0], [[1]], proximal=[[-1.0]])
    assert float(policy_loss(x, LossSettings(tis_cap=2.0)).loss) == pytest.approx(-math.exp(-0.5), rel=1e-5)


def test_sequence_aggregation_weighs_samples_equally():
    per_token = torch.tensor([[1.0, 3.0], [5.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert float(aggregate(per_token, mask, "token")) == pytest.approx(3.0)  # (1+3+5)/3
    assert float(aggregate(per_token, mask, "sequence")) == pytest.approx(3.5)  # (2 + 5)/2
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(per_token, mask, "batch")


def test_gradient_points_up_for_positive_advantage():
    logp = torch.tensor([[-1.0]], requires_grad=True)
    out = policy_loss(
        LossInputs(
            logprobs=logp,
            behaviour_logprobs=torch.tensor([[-1.0]]),
            advantages=torch.tensor([2.0]),
            mask=torch.tensor([[1.0]]),
        ),
        LossSettings(),
    )
    out.loss.backward()
    assert float(logp.grad) == pytest.approx(-2.0)  # d(-ratio*A)/dlogp at ratio 1 = -A


def test_mismatch_by_hand():
    m = logprob_mismatch(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]]), torch.tensor([[1.0, 1.0]]))
    assert m["mean_abs"] == pytest.approx(0.25) and m["max_abs"] == pytest.approx(0.5)
    # k3 for delta 0.5: e^0.5 - 0.5 - 1 = 0.148721; mean over 2 tokens
    assert m["kl"] == pytest.approx((math.exp(0.5) - 1.5) / 2, rel=1e-5)


def test_dr_grpo_aggregation_divides_by_a_constant():
    per_token = torch.tensor([[1.0, 3.0], [5.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # sum over real tokens 1+3+5 = 9; 2 samples x max_tokens 4 = 8 -> 1.125, whatever the lengths
    assert float(aggregate(per_token, mask, "dr_grpo", max_tokens=4)) == pytest.approx(1.125)
    # a longer limit only rescales: 9 / (2 x 6) = 0.75
    assert float(aggregate(per_token, mask, "dr_grpo", max_tokens=6)) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(per_token, mask, "dr_grpo")


def test_dr_grpo_policy_loss_by_hand():
    # on-policy (ratio 1): per-token loss = -A. Sample 1 (A=1) has 2 tokens, sample 2 (A=-0.5) has 1.
    # token mean: -(1 + 1 - 0.5)/3 = -0.5; sequence: -(1 - 0.5)/2 = -0.25; dr_grpo, limit 4: -(1.5)/(2*4) = -0.1875
    x = _inputs([[-1.0, -2.0], [-0.5, 0.0]], [[-1.0, -2.0], [-0.5, 0.0]], [1.0, -0.5], [[1, 1], [1, 0]])
    x.max_tokens = 4
    assert float(policy_loss(x, LossSettings(aggregation="token")).loss) == pytest.approx(-0.5)
    assert float(policy_loss(x, LossSettings(aggregation="sequence")).loss) == pytest.approx(-0.25)
    assert float(policy_loss(x, LossSettings(aggregation="dr_grpo")).loss) == pytest.approx(-0.1875)


def test_train_config_offers_dr_grpo():
    from tasks.config.train import TrainConfig
    from tasks.train.policy_update import loss_settings

    assert loss_settings(TrainConfig(aggregation="dr_grpo")).aggregation == "dr_grpo"
