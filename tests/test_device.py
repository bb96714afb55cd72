"""The round's ``device`` on a machine that may have no GPU: naming the CPU changes nothing, bit for bit; asking
for CUDA where there is none fails where the stage starts, in one line; checkpoints are written from CPU
tensors. What needs a GPU is in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from models.checkpoint import cpu_state_dict
from models.device import DeviceError
from tasks.campaign.base_policy import run_prepare_base
from tasks.config.filter import FilterConfig
from tasks.config.prompts import PromptsConfig
from tasks.config.rollout import RolloutConfig
from tasks.config.verify import VerifyConfig
from tasks.rollout.collection import RolloutCollection
from tasks.serving import engines
from tasks.serving.live import LiveEngines

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="here 'auto' is CUDA: tests/test_gpu.py covers it")


def _rows(tiny_policy_dir: str, **device) -> list[tuple]:
    """A small rollout's rows (what training reads of them) from an engine built as the round builds it."""
    engine, tokenizer = engines.make_engine(
        "embedded", tiny_policy_dir, dtype="float32", policy_version=0, max_batch=16, **device
    )
    result = RolloutCollection(
        engine,
        tokenizer,
        prompts=PromptsConfig(),
        rollout=RolloutConfig(samples_per_prompt=4, max_tokens=10, max_batch=16),
        verify=VerifyConfig(),
        filtering=FilterConfig(drop_zero_variance=False),
        target_groups=3,
        seed=5,
        run_id="t",
        round_index=1,
    ).collect()
    return sorted(
        (r.group_id, r.sample_index, r.completion_token_ids, r.rollout_logprobs, r.finish_reason, r.reward)
        for r in result.rows
    )


@no_gpu
def test_device_cpu_gives_the_rows_the_default_gives(tiny_policy_dir):
    default = _rows(tiny_policy_dir)
    assert default and _rows(tiny_policy_dir, device="cpu") == default


@no_gpu
def test_auto_and_cpu_name_one_live_engine_on_the_cpu(tiny_policy_dir):
    with LiveEngines() as live:
        auto, _, _ = live.serve("embedded", tiny_policy_dir, dtype="float32", policy_version=0)
        cpu, _, _ = live.serve("embedded", tiny_policy_dir, dtype="float32", policy_version=0, device="cpu")
        assert cpu is auto and auto.device == torch.device("cpu")


@no_gpu
@pytest.mark.parametrize("setting", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_fails_where_the_stage_starts(tiny_policy_dir, tmp_path, setting):
    line = f"device '{setting}' asked for CUDA"
    with pytest.raises(DeviceError, match=line) as raised:
        LiveEngines().serve("embedded", tiny_policy_dir, dtype="float32", policy_version=0, device=setting)
    assert "\n" not in str(raised.value) and "set device to 'auto' or 'cpu'" in str(raised.value)
    with pytest.raises(DeviceError, match=line):  # before any weights are read
        engines.build_engine("embedded", tiny_policy_dir, dtype="float32", policy_version=0, device=setting)
    with pytest.raises(DeviceError, match=line):  # before a lease is taken or a step trained
        run_prepare_base(storage=str(tmp_path / "data"), base_model="builtin", device=setting)
    assert not (tmp_path / "data").exists()


def test_a_base_built_on_the_cpu_records_the_kernels_it_ran(tmp_path):
    """AVX2 and AVX-512 kernels round differently and build different bases: the base's lineage says which ran."""
    from models.builtin.base_policy import build_base_policy
    from models.builtin.recipe import BaseRecipe

    meta = build_base_policy(str(tmp_path), BaseRecipe(max_steps=2, check_every=2, stop_at_accuracy=1.0), device="cpu")
    capability = torch.backends.cpu.get_cpu_capability()
    assert meta["trained_on"] == {"device": "cpu", "cpu_capability": capability} and capability


def test_a_cpu_copy_of_the_state_keeps_tied_weights_tied(tmp_path):
    """What save_policy writes for a model on an accelerator: the same file a CPU model writes."""
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    state = cpu_state_dict(model)
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]  # one copy: still tied
    model.save_pretrained(tmp_path / "direct", safe_serialization=True)
    model.save_pretrained(tmp_path / "copied", state_dict=state, safe_serialization=True)
    direct, copied = (load_file(tmp_path / name / "model.safetensors") for name in ("direct", "copied"))
    assert direct.keys() == copied.keys() and "lm_head.weight" not in copied
    assert all(torch.equal(direct[k], copied[k]) for k in direct)


@pytest.mark.parametrize(
    "given, expected",
    [
        ("cuda", "cuda:0"),  # a Ray GPU actor's plain 'cuda': the one GPU it sees
        ("cuda:1", "cuda:1"),  # an index given stays
        ("cpu", "cpu"),  # the CPU has none to add
    ],
)
def test_a_trainer_worker_device_has_an_index(given, expected):
    """torch.cuda.set_device and NCCL refuse a CUDA device without an index; torch's own check runs here without a
    GPU: it refuses plain 'cuda' and accepts what a worker resolves it to."""
    from torch._utils import _get_device_index

    from models.device import indexed

    device = indexed(torch.device(given))
    assert device == torch.device(expected)
    if device.type == "cuda":
        assert _get_device_index(device, optional=False) == device.index
        with pytest.raises(ValueError, match="specified index"):
            _get_device_index(torch.device(given.split(":")[0]), optional=False)


@pytest.mark.parametrize(
    "setting, on_gpu, expected",
    [
        ("auto", True, "bfloat16"),  # a GPU engine: FlashAttention needs a 16-bit dtype
        ("auto", False, "float32"),  # the CPU: float32, as before
        ("float32", True, "float32"),  # a precision asked for is kept
        ("float16", False, "float16"),
    ],
)
def test_engine_dtype_auto(setting, on_gpu, expected):
    from models.device import engine_dtype

    assert engine_dtype(setting, on_gpu) == expected


def test_the_nucleus_is_the_same_with_deterministic_algorithms_on():
    """top_p < 1 under RLROUNDS_DETERMINISTIC=1: the nucleus is computed (on CUDA its floating cumulative sum is
    taken on the CPU, where torch has a deterministic one) and is the one chosen without the setting, bit for bit."""
    from models.device import running_sum
    from models.logprobs import nucleus_drop

    torch.manual_seed(0)
    logits = torch.randn(4, 3, 97) * 3  # [B, T, V]
    top_ps = torch.tensor([0.5, 0.9, 0.99, 1.0]).view(4, 1, 1)
    plain = nucleus_drop(logits, top_ps)
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.equal(nucleus_drop(logits, top_ps), plain)
        probs = logits.softmax(-1)
        assert torch.equal(running_sum(probs), probs.cumsum(-1))
    finally:
        torch.use_deterministic_algorithms(False)
    assert plain.any() and not plain[3].any()  # a nucleus drops tokens; top_p 1 drops none
