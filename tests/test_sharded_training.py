"""Sharded training (train.workers > 1): two gloo workers in processes of their own make the update one
process makes, hold about half of its state each, and save checkpoints either can continue from.

The workers here are plain processes (tasks.train.worker_group.train_in_processes); the Ray worker group
that runs them in a campaign is tested in tests/test_train_group.py."""

from __future__ import annotations

import os
import random

import pytest

torch = pytest.importorskip("torch")

GROUPS, SAMPLES = 5, 4  # with 2 groups per step: minibatches of 2, 2 and 1 groups (a worker idles in the last)


def synthetic_rows(tokenizer, seed: int = 0) -> list[dict]:
    """Kept rows of GROUPS groups: random prompts and completions of varied length, +-1 advantages."""
    rng = random.Random(seed)
    rows = []
    for g in range(GROUPS):
        prompt = [tokenizer.bos_token_id] + [rng.randrange(3, 12) for _ in range(rng.randrange(2, 6))]
        for s in range(SAMPLES):
            longest = 40 if g == 1 else 6  # one group's long answers: its worker's shares run more chunks alone
            completion = [rng.randrange(3, 12) for _ in range(rng.randrange(1, longest + 1))]
            rows.append(
                {
                    "group_id": f"g{g}",
                    "prompt_token_ids": prompt,
                    "completion_token_ids": completion,
                    "rollout_logprobs": [-2.3 + rng.uniform(-0.1, 0.1) for _ in completion],
                    "advantage": 1.0 if s % 2 else -1.0,
                    "token_policy_versions": [0] * len(completion),
                    "sampling": {"top_p": 1.0, "max_tokens": 8},
                }
            )
    return rows


def step_config(**train):
    from tasks.config.train import TrainConfig

    defaults = {"groups_per_step": 2, "steps_per_round": 3, "epochs": 1, "max_kl": None, "learning_rate": 1e-3}
    return TrainConfig(**{**defaults, **train})


def one_process(
    parent: str, rows: list[dict], config, out: str, device: str = "cpu", reference: str | None = None
) -> tuple[dict, dict]:
    """Train in this process as a one-worker round does; save into ``out``; (stats, resident bytes)."""
    from models.checkpoint import load_policy, save_policy
    from models.device import resolve_device, resolve_precision
    from models.sharded import load_optimizer, on_cpu, resident_bytes, save_optimizer
    from tasks.train.policy_update import minibatches, train_policy

    placed = resolve_device(device)
    model, tokenizer = load_policy(parent)
    model.to(placed)
    batches = minibatches(rows, config.groups_per_step, config.steps_per_round)
    state, plan = load_optimizer(parent, model), [True] * len(batches)
    optimizer, stats = train_policy(
        model,
        tokenizer.pad_token_id,
        batches,
        config=config,
        temperature=1.0,
        optimizer=state,
        current_version=0,
        recompute=plan,
        ref_model=load_policy(reference)[0] if reference else None,
        device=placed,
        precision=resolve_precision(config.precision, placed),
    )
    memory = resident_bytes(model, optimizer)
    save_policy(model.cpu(), tokenizer, out)
    save_optimizer(on_cpu(optimizer.state_dict()), out)
    return stats, memory


def two_workers(
    parent: str, rows: list[dict], config, out: str, device: str = "cpu", reference: str | None = None
) -> list:
    from tasks.train.policy_update import minibatches, sharded_minibatches
    from tasks.train.worker_group import TrainJob, train_in_processes, write_files

    steps = len(minibatches(rows, config.groups_per_step, config.steps_per_round))
    shares = sharded_minibatches(rows, config.groups_per_step, config.steps_per_round, None, 2)
    results = train_in_processes(
        2,
        parent,
        shares,
        TrainJob(shares=[], config=config, temperature=1.0, current_version=0, recompute=[True] * steps),
        device,
        reference,
    )
    write_files(out, {name: data for r in results for name, data in r.files.items()})
    return results


def weight_gap(a: str, b: str) -> tuple[float, float]:
    from models.checkpoint import load_state_dict

    left, right = load_state_dict(a), load_state_dict(b)
    assert left.keys() == right.keys()
    diffs = torch.cat([(left[k] - right[k]).abs().flatten() for k in left])
    return float(diffs.max()), float(diffs.mean())


@pytest.mark.parametrize("aggregation", ["token", "sequence", "dr_grpo"])
def test_two_workers_make_the_update_one_makes(tiny_policy_dir, tmp_path, aggregation):
    """Three steps (the last with one group, so one worker holds only a stand-in) at 2 workers land within
    1e-5 of one process's weights, with the same figures; each worker holds at most 0.6x of one process's
    parameter + gradient + optimizer-state bytes."""
    from models.checkpoint import load_policy

    _, tokenizer = load_policy(tiny_policy_dir)
    rows, config = synthetic_rows(tokenizer), step_config(aggregation=aggregation)
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    stats, memory = one_process(tiny_policy_dir, rows, config, one)
    results = two_workers(tiny_policy_dir, rows, config, two)

    worst, mean = weight_gap(one, two)
    assert worst < 1e-5, f"2 workers moved the weights {worst:.2e} (max abs) from one process's update"
    sharded = results[0].stats
    untimed = [{k: v for k, v in r.stats.items() if not k.endswith("_s")} for r in results]
    assert untimed[0] == untimed[1], "every rank reports the whole step's figures"
    assert sharded["train/steps"] == stats["train/steps"] == 3
    assert sharded["train/samples"] == stats["train/samples"] == GROUPS * SAMPLES
    assert sharded["train/mismatch_tokens"] == stats["train/mismatch_tokens"]
    for key in ("train/loss", "train/clip_fraction", "train/grad_norm", "train/mismatch_mean_abs", "train/drift_kl"):
        assert sharded[key] == pytest.approx(stats[key], rel=1e-4, abs=1e-6), key
    whole = sum(memory.values())
    for r in results:
        assert sum(r.memory.values()) <= 0.6 * whole, f"rank {r.rank} holds {r.memory} of {memory}"


def test_checkpoints_continue_across_worker_counts(tiny_policy_dir, tmp_path):
    """A 2-worker checkpoint (optimizer state as DCP shards) continues in one process, and a one-process
    checkpoint (optimizer.pt) on 2 workers: a second round from either lands where one process lands. The
    learning-rate scale of ``drift_target`` (1.5 after a first round far below it) carries both ways."""
    from models.checkpoint import load_policy
    from models.sharded import OPTIMIZER_DIR, OPTIMIZER_FILE, load_optimizer
    from tasks.train.policy_update import SCALE_KEY

    _, tokenizer = load_policy(tiny_policy_dir)
    config = step_config(drift_target=1e3, warmup_steps=0)
    first, second = synthetic_rows(tokenizer, seed=1), synthetic_rows(tokenizer, seed=2)
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    one_process(tiny_policy_dir, first, config, one)
    two_workers(tiny_policy_dir, first, config, two)
    assert os.path.isdir(os.path.join(two, OPTIMIZER_DIR)) and not os.path.exists(os.path.join(two, OPTIMIZER_FILE))

    model = load_policy(two)[0]  # the sharded round's state, read back in one process
    plain, reference = load_optimizer(two, model), load_optimizer(one, model)
    assert plain["state"].keys() == reference["state"].keys()
    assert [g[SCALE_KEY] for g in plain["param_groups"]] == [g[SCALE_KEY] for g in reference["param_groups"]] == [1.5]
    for index, state in reference["state"].items():
        assert float(plain["state"][index]["step"]) == float(state["step"]) == 3
        assert torch.allclose(plain["state"][index]["exp_avg"], state["exp_avg"], rtol=1e-4, atol=1e-5)

    runs = {
        "one -> one": (one, one_process),
        "two -> one": (two, one_process),
        "one -> two": (one, two_workers),
        "two -> two": (two, two_workers),
    }
    for name, (parent, train) in runs.items():
        train(parent, second, config, str(tmp_path / name))
    for name in ("two -> one", "one -> two", "two -> two"):
        worst, _ = weight_gap(str(tmp_path / "one -> one"), str(tmp_path / name))
        assert worst < 1e-5, f"{name}: {worst:.2e} from one process's two rounds"


def test_the_reference_is_sharded_and_built_only_for_a_kl_term(tiny_policy_dir, tmp_path):
    """kl_coef > 0: each worker holds about half of the reference model (sharded as the policy is) and the update
    lands within 1e-5 of one process's with its whole reference; kl_coef 0: no worker builds a reference, even when
    one is handed over. Either way no worker read a tensor larger than the largest parameter (the model is built on
    the meta device and filled one tensor at a time)."""
    from models.checkpoint import load_policy

    model, tokenizer = load_policy(tiny_policy_dir)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    rows = synthetic_rows(tokenizer)
    anchored = step_config(kl_coef=0.1)
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    stats, _ = one_process(tiny_policy_dir, rows, anchored, one, reference=tiny_policy_dir)
    results = two_workers(tiny_policy_dir, rows, anchored, two, reference=tiny_policy_dir)
    worst, _ = weight_gap(one, two)
    assert worst < 1e-5, f"2 workers with a sharded reference moved the weights {worst:.2e} from one process's"
    assert results[0].stats["train/kl"] == pytest.approx(stats["train/kl"], rel=1e-4, abs=1e-7)
    for r in results:
        assert r.reference_bytes is not None and r.reference_bytes <= 0.6 * whole, (r.rank, r.reference_bytes, whole)
        assert 0 < r.largest_read_bytes <= largest, (r.rank, r.largest_read_bytes, largest)

    free = two_workers(tiny_policy_dir, rows, step_config(kl_coef=0.0), str(tmp_path / "free"), reference=one)
    assert [r.reference_bytes for r in free] == [None, None], "kl_coef 0 builds no reference model"


def _load_both_ways(rank: int, path: str, address: str, out: str) -> None:
    import pickle

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from models.checkpoint import load_policy
    from models.sharded import empty_policy, full_weights, load_shards, shard_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=2)
    try:
        loaded = shard_policy(load_policy(path)[0])
        built = shard_policy(empty_policy(path))
        load_shards(built, path, torch.device("cpu"))
        local = {n: (isinstance(p, DTensor), p.to_local().numel(), p.numel()) for n, p in built.named_parameters()}
        tied = built.lm_head.weight is built.model.embed_tokens.weight
        ids = torch.tensor([[1, 5, 7, 9, 3, 4]])
        logits = [m(input_ids=ids).logits.detach() for m in (loaded, built)]
        weights = [full_weights(m) for m in (loaded, built)]
        with open(f"{out}/{rank}.pkl", "wb") as f:  # before the teardown (tasks.train.worker_group.spawn_ranks)
            pickle.dump({"local": local, "tied": tied, "logits": logits, "weights": weights}, f)
        dist.barrier()  # as Worker.leave: a rank that tears its gloo connections down first can abort (SIGABRT)
    finally:
        dist.destroy_process_group()


def test_a_policy_built_on_meta_and_filled_by_shard_is_the_loaded_one(tmp_path):
    """A tied-embedding policy (as Qwen2.5-0.5B) built on the meta device, sharded, then filled from the checkpoint
    a tensor at a time: every parameter a DTensor whose local shard is half of it or less, the head still tied to
    the embedding, and the same weights and logits, bit for bit, as loading it whole and sharding it."""
    import socket

    from transformers import LlamaConfig, LlamaForCausalLM

    from models.builtin.tokenizer import build_char_tokenizer
    from models.checkpoint import save_policy
    from tasks.train.worker_group import spawn_ranks

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    path = str(tmp_path / "tied")
    save_policy(LlamaForCausalLM(config), tokenizer, path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    for rank, seen in enumerate(spawn_ranks(_load_both_ways, (path, address, str(tmp_path)), 2, str(tmp_path))):
        assert seen["tied"], "the output head is the embedding again after loading"
        for name, (sharded, local, full) in seen["local"].items():
            assert sharded and local <= (full + 1) // 2, (rank, name, local, full)
        assert torch.equal(*seen["logits"]), "the filled policy scores as the loaded one"
        if rank == 0:  # the gathered weights
            loaded, built = seen["weights"]
            assert loaded.keys() == built.keys() and all(torch.equal(loaded[k], built[k]) for k in loaded)
