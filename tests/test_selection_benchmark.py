"""benchmarks/selection.py estimates what pre-rollout selection would save from a campaign's stored groups; its
probability and its stream weighting are held here to exact counts."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "selection_benchmark", os.path.join(ROOT, "benchmarks", "selection.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("alpha,beta,samples", [(1, 1, 4), (3, 2, 4), (2, 7, 8), (5, 5, 1)])
def test_zero_variance_probability_is_the_beta_moments(bench, alpha, beta, samples):
    # E[p**n] under Beta(a, b) is the product of (a + i) / (a + b + i) for i < n
    all_right = math.prod((alpha + i) / (alpha + beta + i) for i in range(samples))
    all_wrong = math.prod((beta + i) / (alpha + beta + i) for i in range(samples))
    assert bench.zero_variance_probability(alpha, beta, samples) == pytest.approx(all_right + all_wrong, rel=1e-12)


def test_a_sharp_posterior_is_the_binomial_chance(bench):
    p = 0.8
    assert bench.zero_variance_probability(p * 1e6, (1 - p) * 1e6, 4) == pytest.approx(p**4 + 0.2**4, rel=1e-4)


def test_groups_drawn_at_a_weight_stand_for_the_stream(bench):
    G = bench.GroupOutcome
    # round 1: prompt a solved by every sample, prompt b half right
    history = [G("a", 4, 4, 1.0), G("b", 2, 4, 1.0)]
    # round 2: a was drawn at 0.25 (it stands for 4 of the stream's groups) and is solved again; b informative
    current = [G("a", 4, 4, 0.25), G("b", 1, 4, 1.0)]
    args = SimpleNamespace(from_round=2, history=16, decay=1.0, prior=2.0, floor=0.05, solved_weight=0.5)
    figures = bench.evaluate({1: history, 2: current}, args)
    per_kept = figures["generated_per_kept"]
    assert per_kept["every prompt"] == pytest.approx(5.0)  # 4 + 1 groups generated for 1 kept
    assert per_kept["last group"] == pytest.approx(3.0)  # a admitted at 0.5: 2 + 1 for 1
    assert 1.0 < per_kept["posterior"] < per_kept["last group"]  # a's posterior all but rules it out
    assert sum(row["groups"] for row in figures["calibration"]) == 2
