"""Training correctness on real rounds of tiny policies: the KL reference, dropout and nucleus sampling.
Each round here is rollout -> filter -> train on CPU, with a coin verifier so that a randomly initialised
policy still yields groups with signal. The update on hand-made minibatches is tests/test_policy_update.py."""

import hashlib

import pytest

from tasks.verifiers.outcome import Outcome, Verdict


def coin(completion, reference):
    """Half the completions succeed, decided by their text: groups of a random policy carry signal."""
    heads = int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 2 == 0
    return Verdict(1.0, Outcome.SUCCESS) if heads else Verdict(0.0, Outcome.MODEL_FAILURE)


@pytest.fixture
def coin_verifier(monkeypatch):
    from tasks.config.verify import KNOWN_VERIFIERS
    from tasks.verifiers import registry
    from tasks.verifiers.registry import VerifierSpec

    monkeypatch.setitem(registry.VERIFIERS, "coin", VerifierSpec("test", lambda _config: coin))
    monkeypatch.setitem(KNOWN_VERIFIERS, "coin", "test")
    return "coin"


def _context(storage, parent, run_id="t", round_index=1):
    from tasks.round.context import RoundContext

    return RoundContext(
        storage=storage,
        run_id=run_id,
        round=round_index,
        experiment="t",
        parent_checkpoint=parent,
        parent_policy_version=round_index - 1,
        parent_model_version="none",
        base_model="tiny",
        config_hash="h",
        code_version="test",
        flow_run_id="none",
        mlflow_run_id="none",
        seed=5,
    )


def _round_config(train: dict, top_p: float = 1.0, groups: int = 4):
    from flows.config import RoundConfig

    return RoundConfig.model_validate(
        {
            "verify": {"verifier": "coin"},
            "rollout": {"samples_per_prompt": 4, "max_tokens": 4, "top_p": top_p},
            "train": {"groups_per_step": groups, "steps_per_round": 1, "epochs": 1, **train},
        }
    )


def _trajectories(ctx, config) -> str:
    from tasks.filter.stage import run_filter
    from tasks.rollout.stage import run_rollout
    from tasks.serving.live import LiveEngines

    with LiveEngines() as engines:
        rollout = run_rollout(
            ctx=ctx,
            prompts=config.prompts,
            rollout=config.rollout,
            verify=config.verify_resolved,
            filtering=config.filter,
            target_groups=config.target_groups,
            engines=engines,
        )
    return run_filter(
        ctx=ctx,
        staging=rollout.staging,
        config=config.filter,
        target_groups=config.target_groups,
        rollout_stats=rollout.stats,
    ).uri


def _train(ctx, uri, config, target):
    from flows.resources import CampaignResources
    from tasks.train.stage import run_train

    with CampaignResources() as resources:
        return run_train(
            ctx=ctx,
            trajectory_uri=uri,
            config=config.train,
            temperature=config.rollout.temperature,
            rollout_dtype=config.rollout.dtype,
            target_checkpoint=target,
            engines=resources.engines,
            trainers=resources.trainers,
        )


def _perturbed_round(storage, base_dir) -> str:
    """A committed 'round 1' checkpoint whose weights differ from the base's, with lineage to it."""
    import tempfile

    import torch

    from models.checkpoint import load_policy, save_policy
    from storage import checkpoints
    from storage.paths import StorageRoot

    model, tokenizer = load_policy(base_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    root = StorageRoot.of(storage)
    with tempfile.TemporaryDirectory() as tmp:
        save_policy(model, tokenizer, tmp)
        return checkpoints.commit_checkpoint(
            root, tmp, root.checkpoint("t", 1), {"kind": "round", "round": 1, "parent_checkpoint": base_dir}
        )


def _weights(checkpoint):
    from models.checkpoint import load_state_dict

    return load_state_dict(checkpoint)


# -- 1. the KL reference ------------------------------------------------------------------------------


def test_kl_reference_is_the_base_by_default_and_the_parent_by_name(tmp_path, tiny_policy_dir, coin_verifier):
    from storage import checkpoints
    from storage.paths import StorageRoot

    storage = str(tmp_path / "data")
    parent = _perturbed_round(storage, tiny_policy_dir)
    ctx = _context(storage, parent, round_index=2)
    root = StorageRoot.of(storage)
    assert checkpoints.base_checkpoint(root, parent) == tiny_policy_dir
    base_cfg = _round_config({"kl_coef": 1.0})
    assert base_cfg.train.kl_reference == "base"  # what the field's documentation promises
    uri = _trajectories(ctx, base_cfg)
    # One optimizer step: the KL figure is measured before it, where the policy equals the parent.
    to_base = _train(ctx, uri, base_cfg, str(tmp_path / "to-base"))
    to_parent = _train(ctx, uri, _round_config({"kl_coef": 1.0, "kl_reference": "parent"}), str(tmp_path / "to-parent"))
    assert to_parent.stats["train/kl"] == 0.0  # the reference is the policy itself
    assert to_base.stats["train/kl"] > 1e-4  # the base differs from the parent
    # The new checkpoint records its base, so the next round finds it without walking the chain.
    assert checkpoints.read_lineage(root, to_base.checkpoint)["base_checkpoint"] == tiny_policy_dir
    assert checkpoints.base_checkpoint(root, to_base.checkpoint) == tiny_policy_dir


# -- 2. dropout ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dropout_policy_dir(tmp_path_factory) -> str:
    """A tiny GPT-2 (dropout 0.1 on embeddings, attention and residuals, its defaults) with the built-in tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from models.builtin.tokenizer import build_char_tokenizer
    from models.checkpoint import save_policy

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    assert config.resid_pdrop == config.attn_pdrop == config.embd_pdrop == 0.1
    path = str(tmp_path_factory.mktemp("dropout-policy"))
    save_policy(GPT2LMHeadModel(config), tokenizer, path)
    return path


def test_a_policy_with_dropout_trains_on_policy_and_replays_bitwise(tmp_path, dropout_policy_dir, coin_verifier):
    storage = str(tmp_path / "data")
    ctx = _context(storage, dropout_policy_dir)
    config = _round_config({"recompute_proximal": "never"})
    uri = _trajectories(ctx, config)
    first = _train(ctx, uri, config, str(tmp_path / "a"))
    # Step 0 sees the sampling weights: engine and trainer score the same distribution.
    assert first.stats["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert first.stats["train/mismatch_max_abs"] < 1e-4
    two_steps = _round_config({"steps_per_round": 2, "groups_per_step": 2, "recompute_proximal": "never"})
    a = _weights(_train(ctx, uri, two_steps, str(tmp_path / "b")).checkpoint)
    b = _weights(_train(ctx, uri, two_steps, str(tmp_path / "c")).checkpoint)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


# -- 3. nucleus sampling ------------------------------------------------------------------------------


def test_with_top_p_the_trainer_scores_the_distribution_the_engine_sampled_from(
    tmp_path, tiny_policy_dir, coin_verifier
):
    storage = str(tmp_path / "data")
    ctx = _context(storage, tiny_policy_dir)
    config = _round_config({"recompute_proximal": "never"}, top_p=0.9)
    uri = _trajectories(ctx, config)
    trained = _train(ctx, uri, config, str(tmp_path / "a"))
    # Under the full softmax every sampled token would look log(nucleus mass) less likely than it was.
    assert trained.stats["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert trained.stats["train/mismatch_max_abs"] < 1e-4


@pytest.mark.parametrize(
    "setting, dtype, engine, top_p, expected",
    [
        ("auto", "float32", "embedded", 1.0, False),  # trainer and engine agree to ~1e-6: the pass is waste
        ("auto", "float32", "embedded", 0.9, True),  # a nucleus boundary turns tiny logit gaps into big ones
        ("auto", "bfloat16", "embedded", 1.0, True),  # another precision
        ("auto", "float32", "vllm", 1.0, True),  # other kernels and batching
        ("never", "float32", "embedded", 0.9, False),  # asked for by name
        ("always", "float32", "embedded", 1.0, True),
    ],
)
def test_when_the_proximal_pass_runs(setting, dtype, engine, top_p, expected):
    from tasks.train.policy_update import needs_proximal

    assert needs_proximal(setting, dtype, [{"name": engine, "dtype": dtype}], [top_p]) is expected


def test_a_token_outside_the_current_nucleus_keeps_a_finite_logprob():
    import torch

    from models.logprobs import TokenBatch, token_logprobs

    class Fixed(torch.nn.Module):  # logits that put 0.95 on token 0: the 0.9-nucleus is {0}
        def forward(self, input_ids, attention_mask, position_ids):
            logits = torch.tensor([4.0, 0.0, 0.0, 0.0]).expand(*input_ids.shape, 4).clone()
            return type("Out", (), {"logits": logits.requires_grad_()})()

    batch = TokenBatch(torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.long), torch.ones(1, 1))
    logp = token_logprobs(Fixed(), batch, 1.0, torch.tensor([0.9])).detach()
    full = token_logprobs(Fixed(), batch, 1.0, torch.tensor([1.0])).detach()
    # token 1 left the nucleus: scored over {0, 1}, log(1 / (e^4 + 1)), not -inf and not the full softmax
    assert float(logp) == pytest.approx(-torch.log1p(torch.exp(torch.tensor(4.0))).item(), rel=1e-5)
    assert float(full) < float(logp)


def test_a_recorded_config_without_later_fields_replays_as_its_round_trained():
    """A round recorded before ``epochs`` and ``max_kl`` existed made one pass with no drift limit; a replay
    of it must too, whatever today's defaults are. A config recorded now reads back unchanged."""
    from tasks.config.train import TrainConfig

    older = TrainConfig().model_dump(mode="json")
    del older["epochs"], older["max_kl"], older["minibatch_order"]
    replayed = TrainConfig.recorded(older)
    assert replayed.epochs == 1 and replayed.max_kl is None and replayed.minibatch_order == "stored"
    assert replayed.learning_rate == TrainConfig().learning_rate
    assert TrainConfig.recorded(TrainConfig().model_dump(mode="json")) == TrainConfig()
    assert TrainConfig.recorded(TrainConfig(max_kl=0.5).model_dump(mode="json")).max_kl == 0.5


def test_a_recorded_config_without_the_upper_clip_replays_at_the_clip_it_trained_with():
    """``clip_high``'s default moved from 0.2 to 0.28; a round recorded without the field trained at 0.2."""
    from tasks.config.train import TrainConfig

    older = TrainConfig().model_dump(mode="json")
    del older["clip_high"]
    assert TrainConfig().clip_high == 0.28 and TrainConfig.recorded(older).clip_high == 0.2
    assert TrainConfig.recorded(TrainConfig().model_dump(mode="json")).clip_high == 0.28


def test_a_recorded_config_without_warm_up_replays_without_it():
    """``warmup_steps`` was added with a default of 8; a round recorded before it existed trained without warm-up,
    and one recorded since holds its value."""
    from tasks.config.train import TrainConfig

    older = TrainConfig().model_dump(mode="json")
    del older["warmup_steps"]
    assert TrainConfig().warmup_steps == 8 and TrainConfig.recorded(older).warmup_steps == 0
    assert TrainConfig.recorded(TrainConfig().model_dump(mode="json")).warmup_steps == 8


# -- 4. a group's most varied samples, and prefix credit ----------------------------------------------


def test_a_round_trains_on_each_groups_most_varied_samples_with_prefix_credit(tmp_path, tiny_policy_dir, coin_verifier):
    """A real round at four samples a prompt and ``filter.keep_samples: 2``: every kept group commits one right and
    one wrong sample at +-1 and its other two as 'down_sampled' (rollout counts a group trainable by the same
    decision); the round then trains on them under ``train.credit: prefix``, which moves the weights otherwise than
    'sample' does."""
    from collections import defaultdict

    from storage.paths import StorageRoot
    from storage.trajectories import committed_round_version, read_table

    storage = str(tmp_path / "data")
    ctx = _context(storage, tiny_policy_dir)
    config = _round_config({"credit": "prefix"}).model_copy(deep=True)
    config.filter.keep_samples = 2
    uri = _trajectories(ctx, config)
    rows = read_table(StorageRoot.of(storage), committed_round_version(StorageRoot.of(storage), "t", 1)).to_pylist()
    kept = defaultdict(list)
    for row in rows:
        if row["kept"]:
            kept[row["group_id"]].append(row)
    assert len(kept) == config.target_groups
    for group_id, members in kept.items():
        assert sorted(r["reward"] for r in members) == [0.0, 1.0]
        assert sorted(round(r["advantage"], 4) for r in members) == [-1.0, 1.0]
        others = [r for r in rows if r["group_id"] == group_id and not r["kept"]]
        assert [r["drop_reason"] for r in others] == ["down_sampled"] * 2
    prefix = _train(ctx, uri, config, str(tmp_path / "prefix"))
    assert prefix.stats["train/samples"] == 2 * config.target_groups
    sample = _train(ctx, uri, config.model_copy(update={"train": config.train.model_copy(update={"credit": "sample"})}),
                    str(tmp_path / "sample"))  # fmt: skip
    a, b = _weights(prefix.checkpoint), _weights(sample.checkpoint)
    assert any(not a[k].equal(b[k]) for k in a)
