"""benchmarks/learning_speed.py's ``--seeds``: campaigns paired seed by seed, the ratio only where both sides reached
the target, and seed lists it refuses before any campaign starts."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("learning_speed_benchmark", f"{ROOT}/benchmarks/learning_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def figures(seconds: float | None, rounds: int | None, updates: int | None) -> dict:
    return {"seconds_to_target": seconds, "rounds_to_target": rounds, "updates_to_target": updates}


def test_pairs_compare_seed_by_seed_and_skip_a_missed_target(bench):
    campaigns = [figures(80.0, 13, 416), figures(None, None, None), figures(100.0, 15, 480)]
    baselines = [figures(100.0, 15, 480), figures(90.0, 14, 448), figures(120.0, 16, 512)]
    pairs = bench.paired(campaigns, baselines)
    assert pairs["ratios"] == [pytest.approx(1.25), None, pytest.approx(1.2)]
    assert pairs["median_ratio"] == pytest.approx(1.225)
    assert pairs["campaign_rounds"] == [13, None, 15] and pairs["baseline_updates"] == [480, 448, 512]


def test_no_pair_reaching_the_target_has_no_median(bench, capsys):
    pairs = bench.paired([figures(None, None, None)], [figures(90.0, 14, 448)])
    assert pairs["median_ratio"] is None
    bench.show_pairs([7], pairs)
    assert "seed by seed: -; median none" in capsys.readouterr().out


def test_pairs_need_as_many_baselines_as_campaigns(bench):
    with pytest.raises(ValueError):
        bench.paired([figures(80.0, 13, 416)], [])


@pytest.mark.parametrize(("text", "message"), [("0,x", "comma-separated integers"), ("1,1", "names a seed twice")])
def test_bad_seed_lists_are_refused(bench, text, message):
    with pytest.raises(SystemExit, match=message):
        bench.seeds_of(text)
    assert bench.seeds_of("3,0,12") == [3, 0, 12]
