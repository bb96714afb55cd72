"""filter.history_baseline_rounds: a group that all scored the same trains against its prompt's success rate in the
campaign's history. The rates read from committed versions, the advantages by hand, rollout counting such groups as
trainable, and a refilter reading the same history as its round did."""

from __future__ import annotations

import math

import pytest
from test_curriculum import _commit_round
from test_store import make_row

from storage.paths import StorageRoot
from tasks.config.filter import FilterConfig
from tasks.filter.stage import (
    DROP_ZERO_VARIANCE,
    apply_decisions,
    decide,
    filter_stats,
    group_is_trainable,
    history_advantages,
)

OK, BAD, INFRA = "success", "model_failure", "infra_failure"


def test_the_rate_counts_scored_samples_of_the_window_and_of_this_campaign_only(tmp_path):
    from tasks.filter.history import history_baselines, prompt_success

    root = StorageRoot.of(str(tmp_path))
    _commit_round(root, "c", 1, {"g1": ("a", [OK, OK, OK, OK]), "g2": ("old", [OK, BAD, BAD, BAD])})
    _commit_round(root, "c", 2, {"g3": ("a", [OK, BAD, BAD, BAD]), "g4": ("b", [OK, INFRA, BAD, BAD])})
    _commit_round(root, "c", 3, {"g5": ("a", [BAD, BAD, BAD, BAD]), "g6": ("b", [OK, OK])})
    _commit_round(root, "other", 3, {"g7": ("a", [OK, OK, OK, OK])})  # another campaign's history is not ours

    # round 4 looking back 2 rounds: 'a' 1 of 8, 'b' 3 of 5 scored (the infrastructure failure does not count)
    assert prompt_success(root, "c", 4, 2) == {"a": (1 / 8, 8), "b": (3 / 5, 5)}
    assert prompt_success(root, "c", 4, 3) == {"a": (5 / 12, 12), "b": (3 / 5, 5), "old": (1 / 4, 4)}
    assert prompt_success(root, "c", 1, 4) == {}  # round 1 has no history
    # a baseline needs four scored samples: 'b' has 3 in round 3 alone
    assert history_baselines(root, "c", 4, 1) == {"a": 0.0}
    assert history_baselines(root, "c", 4, None) is None


def _group(group: str, prompt: str, rewards: list[float]) -> list[dict]:
    return [
        {"group_id": group, "prompt_id": prompt, "sample_index": i, "reward": r, "outcome": OK if r else BAD}
        for i, r in enumerate(rewards)
    ]


def test_a_group_that_all_scored_the_same_trains_against_its_prompts_rate():
    rows = _group("right", "p", [1.0] * 4) + _group("wrong", "q", [0.0] * 4) + _group("mixed", "p", [1.0, 0.0])
    rows += _group("sure", "always", [1.0] * 4) + _group("new", "unseen", [0.0] * 4)
    rates = {"p": 0.75, "q": 0.2, "always": 1.0}
    d = decide(rows, FilterConfig(history_baseline_rounds=4), baselines=rates)
    # all right on a prompt solved at 0.75: (1 - 0.75) / sqrt(0.75 x 0.25) = 0.5774
    assert [d[("right", i)].advantage for i in range(4)] == pytest.approx([1 / math.sqrt(3)] * 4, abs=1e-5)
    # all wrong on one solved at 0.2: -0.2 / sqrt(0.16) = -0.5
    assert [d[("wrong", i)].advantage for i in range(4)] == pytest.approx([-0.5] * 4, abs=1e-5)
    assert all(d[(g, i)].kept for g in ("right", "wrong") for i in range(4))
    # a mixed group keeps its own mean and spread, whatever its prompt's history says
    assert [d[("mixed", i)].advantage for i in range(2)] == pytest.approx([1.0, -1.0], abs=1e-5)
    # a rate of 1 (or 0) says nothing new, and a prompt without history has none: dropped as before
    for group in ("sure", "new"):
        assert all(not d[(group, i)].kept and d[(group, i)].drop_reason == DROP_ZERO_VARIANCE for i in range(4))
    # the round's figures count the groups trained against their history
    stats = filter_stats(apply_decisions(rows, d, None))
    assert stats["filter/kept_groups"] == 3 and stats["filter/kept_uniform_groups"] == 2
    # off (no baselines), the same rows are decided as GRPO always did
    off = decide(rows, FilterConfig())
    assert filter_stats(apply_decisions(rows, off, None))["filter/kept_uniform_groups"] == 0
    assert all(off[(g, i)].drop_reason == DROP_ZERO_VARIANCE for g in ("right", "wrong") for i in range(4))
    # without normalising: centred on the rate only
    assert history_advantages([0.0, 0.0], 0.2, normalize_std=False, epsilon=1e-6) == pytest.approx([-0.2, -0.2])
    assert group_is_trainable(_group("w", "q", [0.0] * 4), FilterConfig(), baselines=rates)
    assert not group_is_trainable(_group("w", "q", [0.0] * 4), FilterConfig())


def test_rollout_counts_groups_with_a_history_rate_as_trainable(tiny_policy_dir):
    """The tiny policy gets nearly every answer wrong, so almost every group scores all zero: without rates the
    collection generates up to its cap looking for mixed groups; with a rate for every prompt it stops at the target."""
    from models.builtin.addition import make_prompt
    from models.checkpoint import load_policy
    from models.engines.embedded import EmbeddedEngine
    from tasks.config.prompts import PromptsConfig
    from tasks.config.rollout import RolloutConfig
    from tasks.config.verify import VerifyConfig
    from tasks.rollout.collection import RolloutCollection

    model, tok = load_policy(tiny_policy_dir)
    rates = {make_prompt(a, b).prompt_id: 0.3 for a in range(100) for b in range(100)}

    def collect(baselines):
        engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=32)
        return RolloutCollection(
            engine,
            tok,
            prompts=PromptsConfig(),
            rollout=RolloutConfig(samples_per_prompt=2, max_tokens=4, max_prompts_factor=4.0),
            verify=VerifyConfig(),
            filtering=FilterConfig(history_baseline_rounds=2),
            target_groups=16,
            seed=3,
            run_id="t",
            round_index=2,
            baselines=baselines,
        ).collect()

    without, with_rates = collect(None), collect(rates)
    assert without.stats["rollout/groups_trainable"] < 16  # the cap (64 groups) ran out first
    assert with_rates.stats["rollout/groups_trainable"] >= 16
    assert with_rates.stats["rollout/groups"] < without.stats["rollout/groups"]


def test_refilter_reads_the_history_its_round_read(tmp_path):
    from storage.trajectories import find_version, read_table, rows_to_table, write_version
    from tasks.config.refilter import RefilterRequest
    from tasks.filter.refilter import run_refilter

    root = StorageRoot.of(str(tmp_path / "store"))
    _commit_round(root, "run", 1, {"h1": ("p3", [OK, BAD, BAD, BAD]), "h2": ("p0", [OK, OK, OK, OK])})
    rows = []
    for group, rewards in {0: [1, 0, 1, 0], 3: [1, 1, 1, 1]}.items():
        for index, reward in enumerate(rewards):
            row = make_row(group, index, float(reward))
            row["round"] = 2
            rows.append(row)
    meta = {"kind": "rollout", "run_id": "run", "round": 2, "parent": None, "derivation": {"policy_version": 1}}
    manifest = write_version(root, lambda v: root.trajectory_version("run", 2, v), rows_to_table(rows), meta)

    result = run_refilter(
        storage=root.uri,
        request=RefilterRequest(
            version=manifest.version, where="true", regroup=True, filter=FilterConfig(history_baseline_rounds=1)
        ),
    )
    by_group: dict[str, list[dict]] = {}
    for row in read_table(root, find_version(root, result.version)).to_pylist():
        by_group.setdefault(row["group_id"], []).append(row)
    # g3 (prompt p3) all right, solved 1 of 4 in round 1: (1 - 0.25) / sqrt(0.1875) = sqrt(3)
    assert [r["advantage"] for r in by_group["g3"]] == pytest.approx([math.sqrt(3)] * 4, abs=1e-5)
    assert all(r["kept"] for r in by_group["g3"]) and result.stats["filter/kept_groups"] == 2
    assert result.stats["filter/kept_uniform_groups"] == 1  # g3: trained against its history
    # p0's history is all right (rate 1): its mixed group g0 is judged within itself
    assert [r["advantage"] for r in by_group["g0"]] == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
