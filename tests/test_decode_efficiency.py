"""benchmarks/engine.py's decode-efficiency table counts a model's FLOPs by hand (``model_flops``); its count is
held here to torch's own operator counter on a real forward pass, so the table's percentages mean what they say."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("engine_benchmark", os.path.join(ROOT, "benchmarks", "engine.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def counted(model, length: int, attention: str) -> int:
    """FLOPs torch counts for one forward pass over ``length`` positions under ``attention``."""
    model.config._attn_implementation = attention
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=torch.arange(3, 3 + length).unsqueeze(0))
    return counter.get_total_flops()


@pytest.mark.parametrize(
    "shape",
    [{}, {"hidden_size": 64, "num_layers": 2, "intermediate_size": 96, "num_heads": 2}],
    ids=["built-in", "other-shape"],
)
@pytest.mark.parametrize("length", [1, 9])
def test_model_flops_match_torchs_count_of_a_forward_pass(bench, shape, length):
    model, _ = bench.build_model(**shape)
    linear = counted(model, length, "sdpa")  # torch counts no FLOPs for the fused attention kernel on the CPU
    square = counted(model, length, "eager") - linear  # eager attention: every position against every position
    assert square > 0
    causal = square * (length + 1) / (2 * length)  # a position attends to those before it and itself
    # one prompt of ``length`` positions and one sampled token, which is never fed back: ``length`` positions run
    assert bench.model_flops(model, [length], 1) == pytest.approx(linear + causal, rel=1e-9)


def test_model_flops_add_up_over_rows_and_tokens(bench):
    model, _ = bench.build_model()
    one, other = bench.model_flops(model, [5], 4), bench.model_flops(model, [7], 4)
    assert bench.model_flops(model, [5, 7], 4) == pytest.approx(one + other)
    assert bench.model_flops(model, [5], 4) == pytest.approx(bench.model_flops(model, [8], 1))  # 8 positions each
