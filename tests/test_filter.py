"""Advantages and filtering decisions, against values worked out by hand."""

import math

import pytest

from tasks.config.filter import FilterConfig
from tasks.filter.stage import (
    DROP_INCOMPLETE,
    DROP_INFRA,
    DROP_OVERFLOW,
    DROP_OVERLONG,
    DROP_STALE,
    DROP_ZERO_VARIANCE,
    apply_decisions,
    decide,
    group_advantages,
    overlong_penalty,
)


def test_group_advantages_by_hand():
    # rewards 1,0,0,1: mean 0.5, population std 0.5 -> +-1 (minus a hair for epsilon)
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], normalize_std=True, epsilon=1e-6)
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    # 1,0,0,0: mean 0.25, std sqrt(0.1875) = 0.4330 -> 0.75/0.433 = 1.7321, -0.25/0.433 = -0.5774
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], normalize_std=True, epsilon=0.0)
    assert adv == pytest.approx([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)])
    # without std normalisation: only centred
    assert group_advantages([1.0, 0.0], normalize_std=False, epsilon=1e-6) == [0.5, -0.5]


def _rows(group, rewards, outcomes=None):
    outcomes = outcomes or ["success" if r == 1.0 else "model_failure" for r in rewards]
    return [
        {"group_id": group, "sample_index": i, "reward": r, "outcome": o}
        for i, (r, o) in enumerate(zip(rewards, outcomes))
    ]


def test_zero_variance_groups_are_dropped_with_reason():
    d = decide(_rows("g", [1.0, 1.0, 1.0]), FilterConfig())
    assert all(not x.kept and x.drop_reason == DROP_ZERO_VARIANCE for x in d.values())


def test_infra_failures_leave_the_group_instead_of_scoring_zero():
    rows = _rows("g", [1.0, None, 0.0, 1.0], ["success", "infra_failure", "model_failure", "success"])
    d = decide(rows, FilterConfig())
    assert d[("g", 1)].drop_reason == DROP_INFRA and not d[("g", 1)].kept
    # the remaining 1,0,1: mean 2/3, std sqrt(2)/3 -> advantages 1/sqrt(2), -sqrt(2), 1/sqrt(2)
    assert d[("g", 0)].advantage == pytest.approx(1 / math.sqrt(2), abs=1e-5)
    assert d[("g", 2)].advantage == pytest.approx(-math.sqrt(2), abs=1e-5)


def test_group_with_too_few_scored_samples_is_incomplete():
    rows = _rows("g", [1.0, None, None], ["success", "infra_failure", "infra_failure"])
    d = decide(rows, FilterConfig())
    assert d[("g", 0)].drop_reason == DROP_INCOMPLETE


def test_only_the_first_target_groups_are_kept():
    rows = _rows("a", [1.0, 0.0]) + _rows("b", [1.0, 1.0]) + _rows("c", [0.0, 1.0])
    out = apply_decisions(rows, decide(rows, FilterConfig()), target_groups=1)
    by_group = {(r["group_id"], r["kept"], r["drop_reason"]) for r in out}
    assert by_group == {("a", True, None), ("b", False, DROP_ZERO_VARIANCE), ("c", False, DROP_OVERFLOW)}


@pytest.mark.parametrize(
    "lengths, kept, expected",
    [
        # no bias: every length kept as often as generated
        ([1, 2, 3, 4], [True, True, True, True], {"filter/length_bias": 1.0, "filter/length_q4_kept_share": 0.25}),
        # only short completions kept: the longest quartile is generated but never trained on
        (
            [1, 2, 3, 4],
            [True, True, False, False],
            {
                "filter/length_q4_generated_share": 0.25,
                "filter/length_q4_kept_share": 0.0,
                "filter/length_bias": 1.5 / 2.5,
            },
        ),
        # repeated lengths: fewer buckets, none empty
        (
            [3, 3, 3, 4],
            [True, False, True, True],
            {"filter/length_q1_max_tokens": 3, "filter/length_q2_max_tokens": 4, "filter/length_q2_kept_share": 1 / 3},
        ),
    ],
)
def test_length_bias(lengths, kept, expected):
    from tasks.filter.stage import length_bias

    stats = length_bias([{"completion_token_ids": [0] * n, "kept": k} for n, k in zip(lengths, kept)])
    assert {k: stats[k] for k in expected} == pytest.approx(expected)
    assert "filter/length_q3_max_tokens" not in stats or len(set(lengths)) > 2


def _with(rows, **fields_per_index):
    """rows with per-sample fields: versions=[[...], ...], finish=[...], lengths=[...], max_tokens=N."""
    out = []
    for i, row in enumerate(rows):
        row = dict(row)
        if "versions" in fields_per_index:
            row["token_policy_versions"] = fields_per_index["versions"][i]
        if "finish" in fields_per_index:
            row["finish_reason"] = fields_per_index["finish"][i]
        if "lengths" in fields_per_index:
            row["completion_token_ids"] = [5] * fields_per_index["lengths"][i]
            row["sampling"] = {"max_tokens": fields_per_index["max_tokens"]}
        out.append(row)
    return out


def test_samples_past_max_staleness_leave_their_group_and_the_rest_is_regrouped():
    # trained policy: version 3. Lags: 0, 1 (spans 2..3), 2, 3. max_staleness 1 drops the last two.
    rows = _with(_rows("g", [1.0, 0.0, 1.0, 0.0]), versions=[[3, 3], [2, 3], [1, 1], [0, 3]])
    d = decide(rows, FilterConfig(max_staleness=1), policy_version=3)
    assert [d[("g", i)].drop_reason for i in range(4)] == [None, None, DROP_STALE, DROP_STALE]
    assert [d[("g", i)].advantage for i in range(2)] == pytest.approx([1.0, -1.0], abs=1e-5)
    # no bound, or no known policy version: nobody is stale
    assert all(x.kept for x in decide(rows, FilterConfig(), policy_version=3).values())
    assert all(x.kept for x in decide(rows, FilterConfig(max_staleness=0)).values())
    # what is left must still be a group: one fresh sample is not
    d = decide(rows, FilterConfig(max_staleness=0), policy_version=3)
    assert d[("g", 0)].drop_reason == DROP_INCOMPLETE


def test_overlong_samples_are_kept_dropped_or_penalised():
    rows = _with(
        _rows("g", [1.0, 1.0, 0.0, 1.0]),
        finish=["stop", "stop", "length", "length"],
        lengths=[4, 7, 10, 10],
        max_tokens=10,
    )
    kept = decide(rows, FilterConfig())
    assert all(x.drop_reason is None for x in kept.values())
    dropped = decide(rows, FilterConfig(overlong="drop"))
    # the two left both scored 1: no signal without the samples that ran on
    assert [dropped[("g", i)].drop_reason for i in range(4)] == [DROP_ZERO_VARIANCE] * 2 + [DROP_OVERLONG] * 2
    # penalty over the last 4 tokens: length 4 -> 0, 7 -> -1/4, 10 -> -1. Shaped rewards 1, 0.75, -1, 0.
    assert overlong_penalty(6, 10, 4) == 0.0 and overlong_penalty(7, 10, 4) == -0.25
    assert overlong_penalty(10, 10, 4) == -1.0 and overlong_penalty(12, 10, 4) == -1.0
    shaped = [1.0, 0.75, -1.0, 0.0]
    expected = group_advantages(shaped, normalize_std=True, epsilon=1e-6)
    penalised = decide(rows, FilterConfig(overlong="penalty"))
    assert [penalised[("g", i)].advantage for i in range(4)] == pytest.approx(expected)
    # a group of correct answers, one of them cut at the limit, gets signal only from the penalty
    all_right = _with(_rows("h", [1.0, 1.0]), finish=["stop", "length"], lengths=[3, 10], max_tokens=10)
    assert not any(x.kept for x in decide(all_right, FilterConfig()).values())
    assert all(x.kept for x in decide(all_right, FilterConfig(overlong="penalty")).values())


def test_keep_samples_trains_on_a_groups_most_varied_samples():
    """``filter.keep_samples``: 6 right and 2 wrong of 8 keep 2 of each (the lowest sample indexes among equals),
    advantages over the four kept; 1 right of 8 keeps it and three wrong; a group within the limit, and one that all
    scored the same, are decided as without it; infrastructure failures leave before the choice."""
    from tasks.filter.stage import DROP_DOWN_SAMPLED, filter_stats, most_varied

    config = FilterConfig(keep_samples=4)
    d = decide(_rows("g", [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]), config)
    assert [i for i in range(8) if d[("g", i)].kept] == [0, 1, 2, 5]
    assert {d[("g", i)].drop_reason for i in (3, 4, 6, 7)} == {DROP_DOWN_SAMPLED}
    assert [d[("g", i)].advantage for i in (0, 1, 2, 5)] == pytest.approx([1.0, 1.0, -1.0, -1.0], abs=1e-5)
    d = decide(_rows("g", [0.0] * 5 + [1.0] + [0.0] * 2), config)
    assert [i for i in range(8) if d[("g", i)].kept] == [0, 1, 2, 5]
    assert d[("g", 5)].advantage == pytest.approx(math.sqrt(3), abs=1e-5)
    within = _rows("g", [1.0, 0.0, 0.0, 1.0])
    assert decide(within, config) == decide(within, FilterConfig())
    uniform = _rows("g", [1.0] * 8)
    assert decide(uniform, config) == decide(uniform, FilterConfig())
    failed = _rows("g", [1.0, None, 0.0, 1.0, 0.0], ["success", "infra_failure", *["x"] * 3])
    failed[2]["outcome"] = failed[4]["outcome"] = "model_failure"
    failed[3]["outcome"] = "success"
    d = decide(failed, config)
    assert d[("g", 1)].drop_reason == DROP_INFRA and all(d[("g", i)].kept for i in (0, 2, 3, 4))
    rows = apply_decisions(_rows("g", [1.0] * 6 + [0.0] * 2), decide(_rows("g", [1.0] * 6 + [0.0] * 2), config), None)
    assert filter_stats(rows)["filter/dropped_down_sampled"] == 4
    # graded rewards: the two highest and the two lowest
    assert most_varied([0.1, 0.5, 0.9, 0.3, 0.7, 0.2], list(range(6)), 4) == [0, 2, 4, 5]
    # three of 0, 0.5, 0.5, 0.5, 1: the ends and the first 0.5
    assert most_varied([0.0, 0.5, 0.5, 0.5, 1.0], list(range(5)), 3) == [0, 1, 4]
