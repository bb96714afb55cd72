"""Tests that need a CUDA device (marker ``gpu``; skipped with the reason where there is none).

benchmarks/gpu_check.sh installs what they need and runs them on a GPU machine.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none here)"),
]


# -- vLLM weights from memory


PROMPTS = ["1+2=", "34+56=", "7+89=", "99+99=", "5+5="]


@pytest.fixture(scope="module")
def vllm_base(seed_builtin_base, tmp_path_factory):
    """The built-in base checkpoint, and a small KV cache per engine (two engines share the GPU)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (on a GPU machine: benchmarks/gpu_check.sh)")
    saved = os.environ.get("RLROUNDS_VLLM_ARGS")
    os.environ["RLROUNDS_VLLM_ARGS"] = '{"kv_cache_memory_bytes": 268435456}'
    yield seed_builtin_base(str(tmp_path_factory.mktemp("gpu") / "data"))
    if saved is None:
        os.environ.pop("RLROUNDS_VLLM_ARGS", None)
    else:
        os.environ["RLROUNDS_VLLM_ARGS"] = saved


def _perturbed(base_dir: str, directory: str, device: str) -> dict[str, torch.Tensor]:
    """The base policy moved a little, saved to ``directory`` (its checkpoint) and returned as the
    trainer would hold it: parameter name -> tensor on ``device``."""
    from models.checkpoint import load_policy, save_policy

    model, tokenizer = load_policy(base_dir)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    save_policy(model, tokenizer, directory)
    return {name: t.detach().to(device) for name, t in model.state_dict().items()}


def _greedy(engine, tokenizer) -> dict[str, tuple[list[int], list[float]]]:
    from models.engines.types import GroupRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6)
    groups = [GroupRequest(f"g{i}", tuple(tokenizer(p)["input_ids"]), 1, params) for i, p in enumerate(PROMPTS)]
    return {s.group_id: (s.token_ids, s.logprobs) for s in engine.generate(groups)}


def _assert_same(pushed, reloaded):
    assert {g: t for g, (t, _) in pushed.items()} == {g: t for g, (t, _) in reloaded.items()}
    for g, (_, logprobs) in pushed.items():
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(reloaded[g][1]), atol=1e-5), g


@pytest.mark.vllm
def test_weights_pushed_by_cuda_ipc_serve_as_a_reload_of_their_checkpoint(vllm_base, tmp_path):
    """The in-process engine on the trainer's GPU: the state dict shared by CUDA IPC gives the same greedy
    tokens and logprobs as reloading the checkpoint it was saved to, and the engine was never restarted."""
    from tasks.engines import close_engine, make_engine, takes_weights_from_memory

    engine, tokenizer = make_engine("vllm", vllm_base, "float32", 0, max_batch=64)
    try:
        assert takes_weights_from_memory(engine)
        before = _greedy(engine, tokenizer)
        weights = _perturbed(vllm_base, str(tmp_path), "cuda:0")
        core = engine.llm.llm_engine.engine_core
        pause = engine.push_weights(weights, 1)
        pushed = _greedy(engine, tokenizer)
        assert 0.0 < pause < 60.0 and engine.llm.llm_engine.engine_core is core
        assert {g: t for g, (t, _) in pushed.items()} != {g: t for g, (t, _) in before.items()}

        engine.load_weights(vllm_base, 0)  # back to the base, then the perturbed checkpoint from disk
        engine.load_weights(str(tmp_path), 2)
        _assert_same(pushed, _greedy(engine, tokenizer))
    finally:
        close_engine(engine)


@pytest.mark.vllm
def test_publish_serves_offered_weights_from_memory_and_reports_both_costs(vllm_base, tmp_path):
    """serving_engine with weights offered for a checkpoint pushes them (no reload); without, it reloads."""
    from tasks.engines import drop_serving_engines, serving_engine

    try:
        engine, tokenizer, _ = serving_engine("vllm", vllm_base, "float32", 0, max_batch=64)
        weights = _perturbed(vllm_base, str(tmp_path), "cuda:0")
        _, _, pause = serving_engine("vllm", str(tmp_path), "float32", 1, weights=weights)
        pushed = _greedy(engine, tokenizer)
        serving_engine("vllm", vllm_base, "float32", 0)
        _, _, reload_pause = serving_engine("vllm", str(tmp_path), "float32", 2)
        _assert_same(pushed, _greedy(engine, tokenizer))
        assert pause > 0.0 and reload_pause > 0.0
    finally:
        drop_serving_engines()


@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL from the trainer to a replica needs 2 CUDA devices")
def test_weights_broadcast_over_nccl_to_a_replica_serve_as_a_reload(vllm_base, tmp_path):
    """A vLLM replica (a Ray actor on GPU 0) takes the trainer's tensors (on the last GPU) over NCCL."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    from tasks.engines import Placement, close_engine, make_engine, takes_weights_from_memory

    last = f"cuda:{torch.cuda.device_count() - 1}"  # Ray hands out GPU 0 first: the trainer keeps its own
    engine, tokenizer = make_engine("vllm", vllm_base, "float32", 0, 64, Placement(replicas=1, ray_address="local"))
    try:
        assert takes_weights_from_memory(engine)
        weights = _perturbed(vllm_base, str(tmp_path), last)
        assert engine.push_weights(weights, 1) > 0.0
        pushed = _greedy(engine, tokenizer)
        engine.load_weights(str(tmp_path), 2)
        _assert_same(pushed, _greedy(engine, tokenizer))
    finally:
        close_engine(engine)
