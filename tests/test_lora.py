"""LoRA rounds (train.lora): only the adapters train, the checkpoint the engines load is the policy with them
merged (plain Hugging Face weights), the adapters are kept beside it, and a replay is bit for bit the same."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")


def lora_config(**train):
    from tasks.config.train import TrainConfig

    defaults = {"groups_per_step": 2, "steps_per_round": 3, "epochs": 1, "max_kl": None, "learning_rate": 1e-2}
    return TrainConfig(**{**defaults, "lora": {"rank": 4, "alpha": 8}, **train})


def train_round(parent: str, rows: list[dict], config, out: str) -> dict:
    """The train stage's one-process training of ``rows`` from ``parent`` into ``out``."""
    from tasks.train.policy_update import minibatches
    from tasks.train.stage import train_here

    batches = minibatches(rows, config.groups_per_step, config.steps_per_round)
    stats, _ = train_here(
        parent,
        None,
        batches,
        config=config,
        temperature=1.0,
        current_version=0,
        recompute=[True] * len(batches),
        out=out,
        device=torch.device("cpu"),
        precision="fp32",
        progress=None,
    )
    return stats


def test_a_lora_step_trains_only_the_adapters(tiny_policy_dir):
    from models.checkpoint import load_policy
    from models.memory import add_adapters
    from tasks.train.policy_update import minibatches, train_policy
    from tests.test_sharded_training import synthetic_rows

    model, tokenizer = load_policy(tiny_policy_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    adapted = add_adapters(model, rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], seed=0)
    inner = adapted.get_base_model()
    config = lora_config()
    batches = minibatches(synthetic_rows(tokenizer), 2, 3)
    optimizer, _ = train_policy(
        inner,
        tokenizer.pad_token_id,
        batches,
        config=config,
        temperature=1.0,
        optimizer=None,
        current_version=0,
        recompute=[True] * 3,
    )
    trained = {n for n, p in inner.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(trained)  # Adam state for adapters only
    for name, value in inner.state_dict().items():
        if "lora_" not in name:
            assert torch.equal(value, before[name.replace(".base_layer", "")]), f"{name} moved"
    assert any(float(p.detach().abs().max()) > 0 for n, p in inner.named_parameters() if "lora_B" in n)


def test_a_lora_round_publishes_merged_weights_and_the_adapters(tiny_policy_dir, tmp_path):
    """The checkpoint loads with plain transformers (no peft) and scores what the adapted policy scored; only
    the adapted layers' weights moved; adapter/ holds the adapters; a replay writes the same bytes."""
    from transformers import AutoModelForCausalLM

    from models.checkpoint import load_policy, load_state_dict
    from models.memory import ADAPTER_DIR
    from tests.test_sharded_training import synthetic_rows

    _, tokenizer = load_policy(tiny_policy_dir)
    rows, config = synthetic_rows(tokenizer), lora_config()
    first, again = str(tmp_path / "first"), str(tmp_path / "again")
    train_round(tiny_policy_dir, rows, config, first)
    train_round(tiny_policy_dir, rows, config, again)

    merged = AutoModelForCausalLM.from_pretrained(first)
    assert not any("lora" in name for name in merged.state_dict())
    parent, new = load_state_dict(tiny_policy_dir), load_state_dict(first)
    moved = {k for k in parent if not torch.equal(parent[k], new[k])}
    assert moved and all(k.split(".")[-2] in config.lora.target_modules for k in moved), moved
    adapter = os.path.join(first, ADAPTER_DIR)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert json.load(f)["r"] == 4
    assert os.path.exists(os.path.join(adapter, "adapter_model.safetensors"))
    assert not os.path.exists(os.path.join(first, "optimizer.pt")), "a full fine-tuning round would take it up"

    for name in ("model.safetensors", os.path.join(ADAPTER_DIR, "adapter_model.safetensors")):
        with open(os.path.join(first, name), "rb") as a, open(os.path.join(again, name), "rb") as b:
            assert a.read() == b.read(), f"replay wrote another {name}"


def test_merged_weights_score_as_the_adapted_policy(tiny_policy_dir, tmp_path):
    from peft import PeftModel

    from models.checkpoint import load_policy
    from models.logprobs import completion_logprobs, pack_shared
    from models.memory import ADAPTER_DIR
    from tests.test_sharded_training import synthetic_rows

    _, tokenizer = load_policy(tiny_policy_dir)
    rows = synthetic_rows(tokenizer)
    out = str(tmp_path / "round")
    train_round(tiny_policy_dir, rows, lora_config(), out)
    batch = pack_shared([r["prompt_token_ids"] for r in rows], [r["completion_token_ids"] for r in rows], 0)
    merged = load_policy(out)[0]
    adapted = PeftModel.from_pretrained(load_policy(tiny_policy_dir)[0], os.path.join(out, ADAPTER_DIR)).eval()
    with torch.no_grad():
        a = completion_logprobs(merged, batch)
        b = completion_logprobs(adapted.get_base_model(), batch)
    mask = batch.completion_mask.bool()
    assert torch.allclose(a[mask], b[mask], atol=1e-5)


def test_two_workers_train_the_adapters_one_process_trains(tiny_policy_dir, tmp_path):
    """train.workers 2 under LoRA: the merged checkpoint within 1e-5 of one process's, the adapters beside it."""
    from models.checkpoint import load_policy
    from models.memory import ADAPTER_DIR
    from tests.test_sharded_training import synthetic_rows, two_workers, weight_gap

    _, tokenizer = load_policy(tiny_policy_dir)
    rows, config = synthetic_rows(tokenizer), lora_config()
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    train_round(tiny_policy_dir, rows, config, one)
    two_workers(tiny_policy_dir, rows, config, two)
    worst, _ = weight_gap(one, two)
    assert worst < 1e-5, f"2 workers' merged LoRA policy {worst:.2e} (max abs) from one process's"
    assert os.path.exists(os.path.join(two, ADAPTER_DIR, "adapter_model.safetensors"))
    assert not os.path.exists(os.path.join(two, "optimizer"))
