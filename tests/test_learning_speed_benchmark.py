"""benchmarks/learning_speed.py's ``--seeds``: campaigns paired seed by seed, the ratio only where both sides reached
the target, and seed lists it refuses before any campaign starts."""

from __future__ import annotations

import importlib.util
import json
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


def test_a_comparison_stopped_midway_keeps_the_seeds_it_finished(bench, monkeypatch, tmp_path, capsys):
    """The figures after every seed reach --json; a stop during the third seed leaves the first two's pairs. The
    campaigns are stood in for: what is under test is the benchmark's bookkeeping, which a campaign takes minutes
    to exercise."""
    from argparse import Namespace

    from flows.config import load_campaign_config

    seen = []

    def campaign(config, storage, target, label):
        seen.append((label, config.round.seed))
        if config.round.seed == 5:
            raise KeyboardInterrupt
        rounds = 13 if label.startswith("campaign") else 15
        return figures(float(rounds * 7), rounds, rounds * 32)

    monkeypatch.setattr(bench, "run_campaign", campaign)
    monkeypatch.setattr(bench, "show", lambda figures: None)
    path = str(tmp_path / "pairs.json")
    args = Namespace(seeds="3,4,5", config=None, baseline_config="b.yaml", storage=str(tmp_path), target=0.9)
    with pytest.raises(KeyboardInterrupt):
        bench.by_seed(args, lambda _: load_campaign_config(None, None), lambda out: bench.write_json(path, out))

    assert seen == [("campaign seed 3", 3), ("baseline seed 3", 3), ("campaign seed 4", 4), ("baseline seed 4", 4),
                    ("campaign seed 5", 5)]  # fmt: skip
    with open(path) as f:
        saved = json.load(f)
    assert saved["seeds"] == [3, 4] and saved["seeds_planned"] == [3, 4, 5]
    assert saved["pairs"]["ratios"] == [pytest.approx(15 / 13)] * 2
    assert not os.path.exists(path + ".tmp")
    assert capsys.readouterr().out.count("seconds to target, baseline / campaign, seed by seed") == 2
