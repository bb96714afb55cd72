"""benchmarks/train_step.py's ``--compile`` compares the eager update with one whose decoder-layer parts run under
torch.compile; held here: it compiles the parts it names, leaves the rest eager, and computes the same logits."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", file))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def benches():
    return load("train_step_benchmark", "train_step.py"), load("engine_benchmark", "engine.py")


def compiled(module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def test_none_leaves_the_model_eager(benches):
    train_step, engine = benches
    model, _ = engine.build_model()
    train_step.compile_parts(model, "none")
    assert not any(compiled(m) for m in model.modules())


def test_mlp_norms_compiles_those_parts_and_keeps_the_logits(benches):
    train_step, engine = benches
    model, _ = engine.build_model()
    ids = torch.arange(3, 15).unsqueeze(0)
    with torch.no_grad():
        eager = model(input_ids=ids).logits
    train_step.compile_parts(model, "mlp-norms")
    layers = list(model.model.layers)
    assert all(compiled(layer.mlp) and compiled(layer.input_layernorm) for layer in layers)
    assert not any(compiled(layer) or compiled(layer.self_attn) for layer in layers)
    with torch.no_grad():
        again = model(input_ids=ids).logits
    torch.testing.assert_close(again, eager, rtol=1e-4, atol=1e-5)


def attention_kernels(model, ids) -> tuple[torch.Tensor, set[str]]:
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = model(input_ids=ids).logits
    return logits, {e.key for e in prof.key_averages() if "attention" in e.key}


def test_math_attention_swaps_the_kernel_and_keeps_the_logits(benches):
    train_step, engine = benches
    model, _ = engine.build_model()
    ids = torch.arange(3, 15).unsqueeze(0)
    with train_step.attention_backend("default"):
        default, default_kernels = attention_kernels(model, ids)
    with train_step.attention_backend("math"):
        math, math_kernels = attention_kernels(model, ids)
    assert any("flash" in k for k in default_kernels), default_kernels
    assert not any("flash" in k for k in math_kernels), math_kernels
    torch.testing.assert_close(math, default, rtol=1e-4, atol=1e-5)
