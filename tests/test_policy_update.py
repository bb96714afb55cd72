"""The policy update on hand-made minibatches: the engine/trainer mismatch at the sampling weights, epochs over a
round's minibatches, the drift limit, freshness (version lag and divergence), when the proximal pass runs, and the
minibatch order. Each test drives ``train_policy`` directly on a tiny policy, on CPU."""

import pytest


def two_sample_batch(tokenizer):
    """One group of two 3-token samples of one prompt, advantages +1 and -1, sampled at version 0."""
    from tasks.train.policy_update import TrainBatch

    prompt = [tokenizer.bos_token_id, 3, 4, 13]
    return TrainBatch(
        prompt_ids=[prompt] * 2,
        completion_ids=[[5, 6, 7], [8, 9, 2]],
        behaviour=[[-2.0] * 3] * 2,
        advantages=[1.0, -1.0],
        policy_versions=[[0] * 3] * 2,
        top_p=[1.0] * 2,
        max_tokens=3,
    )


# -- the mismatch figure is taken at the sampling weights, the drift apart -----------------------------


@pytest.mark.parametrize("recompute", [True, False])
def test_mismatch_is_measured_at_the_sampling_weights(tiny_policy_dir, recompute):
    """Engine vs trainer is compared where the trainer holds the weights that sampled: every minibatch's
    proximal pass, or else the first minibatch before any update. The later minibatches' distance from
    the sampling logprobs is the round's drift, reported in its own figures."""
    import torch

    from models.checkpoint import load_policy
    from models.logprobs import pack_sequences, token_logprobs
    from tasks.config.train import TrainConfig
    from tasks.train.policy_update import TrainBatch, train_policy

    model, tokenizer = load_policy(tiny_policy_dir)
    torch.manual_seed(0)
    prompts = [[tokenizer.bos_token_id, 3, 4, 13] for _ in range(4)]
    completions = [torch.randint(3, 12, (3,)).tolist() for _ in range(4)]

    def exact(rows):  # the trainer's own logprobs at these weights, per completion token
        packed = pack_sequences([prompts[i] for i in rows], [completions[i] for i in rows], tokenizer.pad_token_id)
        with torch.no_grad():
            logp = token_logprobs(model, packed, 1.0)
        return [logp[j, 3:6].tolist() for j in range(len(rows))]

    first, second = exact([0, 1]), exact([2, 3])
    shifted = [[v - 0.5 for v in row] for row in second]  # the engine disagrees by 0.5 nats on minibatch 2 only
    batches = [
        TrainBatch(
            prompt_ids=[prompts[0], prompts[1]],
            completion_ids=completions[:2],
            behaviour=first,
            advantages=[1.0, -1.0],
            policy_versions=[[0] * 3] * 2,
            top_p=[1.0, 1.0],
            max_tokens=3,
        ),
        TrainBatch(
            prompt_ids=[prompts[2], prompts[3]],
            completion_ids=completions[2:],
            behaviour=shifted,
            advantages=[1.0, -1.0],
            policy_versions=[[0] * 3] * 2,
            top_p=[1.0, 1.0],
            max_tokens=3,
        ),
    ]
    # without the proximal pass a 0.5-nat disagreement reads as drift: no drift limit here
    config = TrainConfig(max_kl=None)
    _, stats = train_policy(
        model,
        tokenizer.pad_token_id,
        batches,
        config=config,
        temperature=1.0,
        optimizer=None,
        current_version=0,
        recompute=recompute,
    )
    if recompute:  # every minibatch at the sampling weights: 6 of 12 tokens off by 0.5
        assert stats["train/mismatch_mean_abs"] == pytest.approx(0.25, abs=1e-5)
        assert stats["train/mismatch_max_abs"] == pytest.approx(0.5, abs=1e-5)
        assert stats["train/mismatch_tokens"] == 12
        # the drift is the trainer's own: one small update past the proximal logprobs, not the engine's 0.5
        assert 0.0 < stats["train/drift_max_abs"] < 2e-2
    else:  # only the first minibatch is at the sampling weights, where engine and trainer agree
        assert stats["train/mismatch_max_abs"] < 1e-5
        assert stats["train/mismatch_tokens"] == 6
        # minibatch 2, one update on, against behaviour logprobs 0.5 off: the drift figure holds it
        assert stats["train/drift_max_abs"] == pytest.approx(0.5, abs=2e-2)
        assert stats["train/drift_mean_abs"] == pytest.approx(0.25, abs=2e-2)


@pytest.mark.parametrize("recompute", [True, False])
def test_epochs_repeat_the_rounds_minibatches_in_order(tiny_policy_dir, recompute):
    """Two passes over [a, b] are the updates of one pass over [a, b, a, b], with the proximal logprobs
    of the sampling weights; the mismatch figure is the first pass's, the staleness counts every step."""
    import copy

    import torch

    from models.checkpoint import load_policy
    from tasks.config.train import TrainConfig
    from tasks.train.policy_update import TrainBatch, train_policy

    model, tokenizer = load_policy(tiny_policy_dir)
    a = two_sample_batch(tokenizer)
    b = TrainBatch(
        prompt_ids=a.prompt_ids,
        completion_ids=[[9, 5, 2], [6, 6, 6]],
        behaviour=[[-2.5] * 3] * 2,
        advantages=[-1.0, 1.0],
        policy_versions=[[0] * 3] * 2,
        top_p=[1.0] * 2,
        max_tokens=3,
    )
    twice, once = copy.deepcopy(model), copy.deepcopy(model)
    # made-up behaviour logprobs are far from the model's: no drift limit, or the first update would be the last
    two, one = TrainConfig(epochs=2, max_kl=None), TrainConfig(epochs=1, max_kl=None)
    _, stats = train_policy(
        twice,
        tokenizer.pad_token_id,
        [a, b],
        config=two,
        temperature=1.0,
        optimizer=None,
        current_version=0,
        recompute=recompute,
    )
    _, flat = train_policy(
        once,
        tokenizer.pad_token_id,
        [a, b, a, b],
        config=one,
        temperature=1.0,
        optimizer=None,
        current_version=0,
        recompute=recompute,
    )
    for p, q in zip(twice.parameters(), once.parameters()):
        assert torch.equal(p, q)
    assert not all(torch.equal(p, q) for p, q in zip(twice.parameters(), model.parameters()))
    assert stats["train/steps"] == 4 and stats["train/samples"] == 4  # two passes over the same 4 rows
    assert stats["train/staleness_max_steps"] == 3
    # at the sampling weights: every first-pass minibatch with the proximal pass, else the first one
    assert (stats["train/mismatch_tokens"], flat["train/mismatch_tokens"]) == ((12, 24) if recompute else (6, 6))


def test_updates_stop_once_the_policy_drifts_past_max_kl(tiny_policy_dir):
    """The round stops before the first minibatch whose tokens the policy has moved past ``max_kl`` from:
    its weights are those of training on the minibatches before it, and the stop is reported."""
    import copy

    import torch

    from models.checkpoint import load_policy
    from models.logprobs import completion_logprobs, pack_shared
    from tasks.config.train import TrainConfig
    from tasks.train.policy_update import TrainBatch, train_policy

    model, tokenizer = load_policy(tiny_policy_dir)
    torch.manual_seed(0)
    batches = []
    for _ in range(4):
        prompts = [[tokenizer.bos_token_id, 3, int(torch.randint(4, 12, ())), 13]] * 4
        completions = [torch.randint(3, 12, (3,)).tolist() for _ in prompts]
        with torch.no_grad():  # behaviour logprobs: the sampling policy's own, as the fp32 engine records
            behaviour = completion_logprobs(model, pack_shared(prompts, completions, tokenizer.pad_token_id))
        batches.append(
            TrainBatch(
                prompt_ids=prompts,
                completion_ids=completions,
                behaviour=behaviour.tolist(),
                advantages=[1.0, -1.0, 1.0, -1.0],
                policy_versions=[[0] * 3] * 4,
                top_p=[1.0] * 4,
                max_tokens=3,
            )
        )
    fast = dict(learning_rate=5e-3, epochs=2)
    free, limited = copy.deepcopy(model), copy.deepcopy(model)
    _, all_steps = train_policy(
        free,
        tokenizer.pad_token_id,
        batches,
        config=TrainConfig(**fast, max_kl=None),
        temperature=1.0,
        optimizer=None,
        current_version=0,
        recompute=False,
    )
    _, stopped = train_policy(
        limited,
        tokenizer.pad_token_id,
        batches,
        config=TrainConfig(**fast, max_kl=1e-3),
        temperature=1.0,
        optimizer=None,
        current_version=0,
        recompute=False,
    )
    assert all_steps["train/steps"] == 8 and all_steps["train/stopped_at_kl"] == 0.0
    steps = int(stopped["train/steps"])
    assert 1 <= steps < 8 and stopped["train/stopped_at_kl"] == 1.0 and stopped["train/drift_kl"] > 1e-3
    assert stopped["train/samples"] == 4 * min(steps, 4)
    replay = copy.deepcopy(model)  # the same updates, made by asking for exactly those minibatches
    schedule = [batches[i % 4] for i in range(steps)]
    train_policy(
        replay,
        tokenizer.pad_token_id,
        schedule,
        config=TrainConfig(**dict(fast, epochs=1), max_kl=None),
        temperature=1.0,
        optimizer=None,
        current_version=0,
        recompute=False,
    )
    for p, q in zip(replay.parameters(), limited.parameters()):
        assert torch.equal(p, q)


def test_warm_up_ramps_the_learning_rate_over_the_optimizers_first_steps_across_rounds(tiny_policy_dir):
    """``warmup_steps``: the first step of a fresh optimizer is a step at 1/N of the learning rate (the same update
    as a step without warm-up at that rate), and the ramp goes on from the step count in the state a round hands
    the next."""
    import copy

    import torch

    from models.checkpoint import load_policy
    from tasks.config.train import TrainConfig
    from tasks.train.policy_update import steps_taken, train_policy

    model, tokenizer = load_policy(tiny_policy_dir)
    batch = two_sample_batch(tokenizer)
    rate = 1e-3
    common = dict(temperature=1.0, current_version=0, recompute=False)
    ramped, plain = copy.deepcopy(model), copy.deepcopy(model)
    config = TrainConfig(learning_rate=rate, warmup_steps=4, epochs=1, max_kl=None)
    optimizer, first = train_policy(ramped, tokenizer.pad_token_id, [batch], config=config, optimizer=None, **common)
    train_policy(
        plain,
        tokenizer.pad_token_id,
        [batch],
        config=TrainConfig(learning_rate=rate / 4, epochs=1, max_kl=None, warmup_steps=0),
        optimizer=None,
        **common,
    )
    for p, q in zip(ramped.parameters(), plain.parameters()):
        assert torch.equal(p, q)
    assert first["train/learning_rate"] == rate / 4
    # the next round continues from the state it was handed: steps 2-5 at 2/4, 3/4, 4/4 and 4/4 of the rate
    state = optimizer.state_dict()
    optimizer, later = train_policy(
        ramped, tokenizer.pad_token_id, [batch] * 4, config=config, optimizer=state, **common
    )
    assert steps_taken(optimizer) == 5
    assert later["train/learning_rate"] == pytest.approx(rate * (0.5 + 0.75 + 1 + 1) / 4)
    unramped_config = TrainConfig(epochs=1, warmup_steps=0)
    _, unramped = train_policy(
        copy.deepcopy(model), tokenizer.pad_token_id, [batch], config=unramped_config, optimizer=None, **common
    )
    assert unramped["train/learning_rate"] == TrainConfig().learning_rate  # 0: no ramp


def test_drift_target_scales_the_next_rounds_learning_rate_from_the_state_it_hands_on(tiny_policy_dir):
    """``drift_target``: a round that ended below half the target hands the next round 1.5x the rate, one stopped
    at ``max_kl`` hands it the rate / 1.5; the scale travels in the optimizer's state, and without a target the
    rate stays fixed."""
    import copy

    from models.checkpoint import load_policy
    from tasks.config.train import TrainConfig
    from tasks.train.policy_update import rate_scale, train_policy

    model, tokenizer = load_policy(tiny_policy_dir)
    batch = two_sample_batch(tokenizer)
    rate, common = 1e-4, dict(temperature=1.0, current_version=0, recompute=False)
    config = TrainConfig(learning_rate=rate, warmup_steps=0, epochs=1, max_kl=None, drift_target=1e3)
    optimizer, first = train_policy(model, tokenizer.pad_token_id, [batch], config=config, optimizer=None, **common)
    assert first["train/learning_rate"] == rate and first["train/lr_scale_next"] == 1.5  # drift far below 500
    state = copy.deepcopy(optimizer.state_dict())
    optimizer, second = train_policy(model, tokenizer.pad_token_id, [batch], config=config, optimizer=state, **common)
    assert second["train/learning_rate"] == pytest.approx(rate * 1.5) and rate_scale(optimizer) == 2.25
    # every later step drifts past a tiny max_kl: the round stops, and the next starts a step lower
    stopping = config.model_copy(update={"max_kl": 1e-12, "drift_target": 1e-12})
    state = copy.deepcopy(optimizer.state_dict())
    optimizer, third = train_policy(
        model, tokenizer.pad_token_id, [batch] * 3, config=stopping, optimizer=state, **common
    )
    assert third["train/stopped_at_kl"] == 1.0 and third["train/lr_scale_next"] == 1.5
    fixed = config.model_copy(update={"drift_target": None})
    _, plain = train_policy(
        copy.deepcopy(model), tokenizer.pad_token_id, [batch], config=fixed, optimizer=optimizer.state_dict(), **common
    )
    assert plain["train/learning_rate"] == rate  # the scale in the state is not read without a target
    for scale in ((1 / 8) / 1.5, 8 * 1.5):  # held within its bounds
        state = copy.deepcopy(optimizer.state_dict())
        for group in state["param_groups"]:
            group["rlrounds_lr_scale"] = scale
        _, bounded = train_policy(
            copy.deepcopy(model), tokenizer.pad_token_id, [batch], config=config, optimizer=state, **common
        )
        assert 1 / 8 <= bounded["train/lr_scale_next"] <= 8


def test_adam_beta2_reaches_the_optimizer_over_the_state_a_round_hands_on(tiny_policy_dir):
    """``adam_beta2`` is the AdamW second-moment decay of every step, also when the state handed on was saved
    under another one (a loaded state brings its own betas); the default is torch's 0.999."""
    import copy

    import torch

    from models.checkpoint import load_policy
    from tasks.config.train import TrainConfig
    from tasks.train.policy_update import train_policy

    model, tokenizer = load_policy(tiny_policy_dir)
    batch = two_sample_batch(tokenizer)
    common = dict(temperature=1.0, current_version=0, recompute=False)
    plain = TrainConfig(epochs=1, max_kl=None)
    optimizer, _ = train_policy(model, tokenizer.pad_token_id, [batch], config=plain, optimizer=None, **common)
    assert [g["betas"] for g in optimizer.param_groups] == [(0.9, 0.999)] * len(optimizer.param_groups)
    state = copy.deepcopy(optimizer.state_dict())
    faster = plain.model_copy(update={"adam_beta2": 0.99})
    optimizer, _ = train_policy(model, tokenizer.pad_token_id, [batch], config=faster, optimizer=state, **common)
    assert {g["betas"] for g in optimizer.param_groups} == {(0.9, 0.99)}
    # the decay changes the update: the same step from the same state under each decay differs
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    train_policy(a, tokenizer.pad_token_id, [batch], config=plain, optimizer=copy.deepcopy(state), **common)
    train_policy(b, tokenizer.pad_token_id, [batch], config=faster, optimizer=copy.deepcopy(state), **common)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# -- freshness: lag in policy versions and divergence from the behaviour policy ------------------------


def test_freshness_figures_by_hand():
    import math

    import torch

    from tasks.train.policy_update import freshness_stats

    # four tokens: lags 0, 0, 1, 3; log weights 0, 0, log 1.5, log 4 (tis_cap 2: only the last is over it)
    tokens = torch.tensor([[0, 0.0], [0, 0.0], [1, math.log(1.5)], [3, math.log(4)]])
    s = freshness_stats(tokens, tis_cap=2.0)
    assert s["train/lag_versions_mean"] == 1.0 and s["train/lag_versions_max"] == 3.0
    assert s["train/lag_versions_p50"] == 0.5  # linear interpolation between the middle two
    assert s["train/behaviour_weight_mean"] == pytest.approx((1 + 1 + 1.5 + 4) / 4)
    # k3 = w - 1 - log w: 0, 0, 0.5 - log 1.5, 3 - log 4
    assert s["train/behaviour_kl_k3"] == pytest.approx((0.5 - math.log(1.5) + 3 - math.log(4)) / 4)
    assert s["train/behaviour_weight_over_cap"] == 0.25
    assert freshness_stats(torch.zeros((0, 2)), 2.0) == {}


def test_tokens_of_older_versions_are_measured_as_lag(tiny_policy_dir):
    import torch

    from models.checkpoint import load_policy
    from tasks.config.train import TrainConfig
    from tasks.train.policy_update import TrainBatch, train_policy

    model, tokenizer = load_policy(tiny_policy_dir)
    prompts = [[tokenizer.bos_token_id, 3, 4, 13]] * 2
    completions = [[5, 6, 7], [8, 9, 10]]
    behaviour = [[-2.0] * 3, [-2.0] * 3]
    # trained policy version 2: the first sample's first token came from version 0, the rest from 2
    versions = [[0, 2, 2], [2, 2, 2]]
    batch = TrainBatch(
        prompt_ids=prompts,
        completion_ids=completions,
        behaviour=behaviour,
        advantages=[1.0, -1.0],
        policy_versions=versions,
        top_p=[1.0, 1.0],
        max_tokens=3,
    )
    torch.manual_seed(0)
    _, stats = train_policy(
        model,
        tokenizer.pad_token_id,
        [batch],
        config=TrainConfig(),
        temperature=1.0,
        optimizer=None,
        current_version=2,
        recompute=True,
    )
    assert stats["train/lag_versions_max"] == 2.0 and stats["train/lag_versions_mean"] == pytest.approx(2 / 6)
    assert stats["train/samples_spanning_versions_share"] == 0.5
    assert stats["train/behaviour_kl_k3"] > 0 and stats["train/behaviour_weight_p99"] > 0


def test_the_proximal_pass_runs_only_for_the_minibatches_that_need_it():
    from tasks.train.policy_update import TrainBatch, proximal_plan

    def batch(versions, top_p=1.0):
        return TrainBatch(
            prompt_ids=[[1]],
            completion_ids=[[2] * len(versions)],
            behaviour=[[0.0] * len(versions)],
            advantages=[1.0],
            policy_versions=[versions],
            top_p=[top_p],
            max_tokens=4,
        )

    embedded = [{"name": "embedded", "dtype": "float32"}]
    carried, fresh, nucleus = batch([1, 2]), batch([2, 2]), batch([2, 2], top_p=0.9)
    assert proximal_plan("auto", "float32", embedded, [carried, fresh, nucleus], 2) == [True, False, True]
    # the round's engine or precision decide for every minibatch; an explicit setting overrides all
    assert proximal_plan("auto", "bfloat16", embedded, [fresh, fresh], 2) == [True, True]
    assert proximal_plan("auto", "float32", [{"name": "vllm", "dtype": "float32"}], [fresh], 2) == [True]
    assert proximal_plan("never", "float32", embedded, [carried], 2) == [False]
    assert proximal_plan("always", "float32", embedded, [fresh], 2) == [True]


def twelve_groups(versions) -> list[dict]:
    """Kept rows of twelve groups of two samples, group g's prompt [1, g]; ``versions(group, sample)``: the policy
    version of each of a sample's two tokens."""
    return [
        {
            "group_id": f"g{g}",
            "prompt_token_ids": [1, g],
            "completion_token_ids": [2, s],
            "rollout_logprobs": [0.0, 0.0],
            "advantage": float(s),
            "token_policy_versions": versions(g, s),
            "sampling": {"top_p": 1.0, "max_tokens": 4},
        }
        for g in range(12)
        for s in range(2)
    ]


def test_shuffled_minibatches_depend_on_the_rows_and_the_seed_not_their_stored_order():
    """Whole groups, every kept row once; the same minibatches whatever order the groups were stored in,
    others for another seed; stored order keeps the groups as they finished."""
    import random

    from tasks.train.policy_update import minibatches

    rows = twelve_groups(lambda group, sample: [0, 0])

    def groups(batches):
        return [[p[1] for p in b.prompt_ids] for b in batches]

    stored = groups(minibatches(rows, 3, 4))
    assert stored == [[0, 0, 1, 1, 2, 2], [3, 3, 4, 4, 5, 5], [6, 6, 7, 7, 8, 8], [9, 9, 10, 10, 11, 11]]
    shuffled = groups(minibatches(rows, 3, 4, shuffle_seed=0))
    assert shuffled != stored and sorted(g for b in shuffled for g in b) == sorted(g for b in stored for g in b)
    by_group = [rows[i : i + 2] for i in range(0, len(rows), 2)]
    random.Random(1).shuffle(by_group)
    assert groups(minibatches([r for g in by_group for r in g], 3, 4, shuffle_seed=0)) == shuffled
    assert groups(minibatches(rows, 3, 4, shuffle_seed=1)) != shuffled
    assert groups(minibatches(rows, 3, 2, shuffle_seed=0)) == shuffled[:2]  # fewer steps: a prefix


def test_carried_first_puts_carried_over_groups_together_so_only_their_minibatches_recompute():
    """'carried_first' orders groups as 'shuffled' does within the carried-over and the fresh ones, carried-over
    ones first: four carried-over groups spread over the shuffled minibatches fill the first two, and the
    proximal pass then scores two minibatches instead of every one that held one."""
    from tasks.train.policy_update import minibatches, proximal_plan, sharded_minibatches

    carried_ids = {1, 4, 7, 10}  # a sample of each resumed from the round before (policy version 2, parent 3)
    rows = twelve_groups(lambda group, sample: [2, 3] if group in carried_ids and sample == 0 else [3, 3])

    def groups(batches):
        return [[p[1] for p in b.prompt_ids[::2]] for b in batches]

    embedded = [{"name": "embedded", "dtype": "float32"}]
    shuffled = minibatches(rows, 2, 6, shuffle_seed=0)
    first = minibatches(rows, 2, 6, shuffle_seed=0, carried_before=3)
    spread = sum(proximal_plan("auto", "float32", embedded, shuffled, 3))
    assert spread > 2  # the seed spreads the four over more than two minibatches: the test means something
    assert proximal_plan("auto", "float32", embedded, first, 3) == [True, True, False, False, False, False]
    assert set(sum(groups(first)[:2], [])) == carried_ids
    order = sum(groups(shuffled), [])  # the hashed order holds within each part
    assert sum(groups(first), []) == [g for g in order if g in carried_ids] + [g for g in order if g not in carried_ids]
    fresh = twelve_groups(lambda group, sample: [3, 3])  # every token the parent's: nothing to put first
    assert groups(minibatches(fresh, 2, 6, shuffle_seed=0, carried_before=3)) == groups(minibatches(fresh, 2, 6, 0))
    shares = sharded_minibatches(rows, 2, 6, 0, 2, carried_before=3)  # two workers: a group each, the same steps
    assert [a + b for a, b in zip(groups(shares[0]), groups(shares[1]))] == groups(first)
