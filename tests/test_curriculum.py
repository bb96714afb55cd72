"""The history curriculum: which prompts count as solved, the seeded draw, and what rollout records."""

from __future__ import annotations

import pytest


def _commit_round(root, run_id: str, round_index: int, groups: dict[str, tuple[str, list[str]]]) -> None:
    """Commit a round's trajectory version holding ``groups``: group_id -> (prompt_id, outcomes)."""
    from storage.trajectories import rows_to_table, write_version

    rows = [
        {
            "run_id": run_id,
            "round": round_index,
            "prompt_id": prompt,
            "group_id": group,
            "sample_index": i,
            "outcome": outcome,
            "reward": 1.0 if outcome == "success" else 0.0,
        }
        for group, (prompt, outcomes) in groups.items()
        for i, outcome in enumerate(outcomes)
    ]
    meta = {"kind": "rollout", "run_id": run_id, "round": round_index, "parent": None, "derivation": {}}
    write_version(root, lambda v: root.trajectory_version(run_id, round_index, v), rows_to_table(rows), meta)


def test_solved_means_every_sample_of_the_latest_group_in_the_window(tmp_path):
    from storage.paths import StorageRoot
    from tasks.rollout.curriculum import solved_prompts

    root = StorageRoot.of(str(tmp_path))
    ok, bad, infra = "success", "model_failure", "infra_failure"
    _commit_round(root, "c", 1, {"g1": ("a", [ok, ok]), "g2": ("b", [ok, ok]), "g3": ("old", [ok, ok])})
    _commit_round(root, "c", 2, {"g4": ("a", [ok, bad]), "g5": ("c", [ok, ok]), "g6": ("d", [ok, infra])})
    _commit_round(root, "c", 3, {"g7": ("b", [ok, ok]), "g8": ("e", [bad, bad])})
    _commit_round(root, "other", 3, {"g9": ("f", [ok, ok])})  # another campaign's history is not ours

    # round 4 looking back 2 rounds sees rounds 2 and 3: 'a' failed last time, 'old' is out of the
    # window, an infrastructure failure is not a success, 'e' failed everywhere
    assert solved_prompts(root, "c", 4, history_rounds=2) == {"b", "c"}
    assert solved_prompts(root, "c", 4, history_rounds=3) == {"b", "c", "old"}
    assert solved_prompts(root, "c", 1, history_rounds=4) == frozenset()  # round 1 has no history


def test_the_draw_is_seeded_and_has_the_asked_probability():
    from tasks.rollout.curriculum import admitted

    draws = [admitted(7, position, 0.25) for position in range(20_000)]
    assert sum(draws) / len(draws) == pytest.approx(0.25, abs=0.015)
    assert draws == [admitted(7, position, 0.25) for position in range(20_000)]  # a re-run draws the same
    assert draws != [admitted(8, position, 0.25) for position in range(20_000)]  # another round draws anew
    assert all(admitted(7, position, 1.0) for position in range(100))


def test_rollout_draws_solved_prompts_less_and_records_the_weight(tiny_policy_dir):
    from models.builtin.addition import make_prompt
    from models.checkpoint import load_policy
    from models.engines.embedded import EmbeddedEngine
    from tasks.config.filter import FilterConfig
    from tasks.config.prompts import PromptsConfig
    from tasks.config.rollout import RolloutConfig
    from tasks.config.verify import VerifyConfig
    from tasks.rollout.collection import RolloutCollection

    model, tok = load_policy(tiny_policy_dir)
    solved = frozenset(make_prompt(a, b).prompt_id for a in range(100) for b in range(50))  # half the pairs

    def collect(weight: float) -> list[dict]:
        engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=64)
        result = RolloutCollection(
            engine,
            tok,
            prompts=PromptsConfig(solved_weight=weight),
            rollout=RolloutConfig(samples_per_prompt=2, max_tokens=4),
            verify=VerifyConfig(),
            filtering=FilterConfig(drop_zero_variance=False),
            target_groups=200,
            seed=3,
            run_id="t",
            round_index=2,
            solved=solved,
        ).collect()
        assert result.stats["rollout/curriculum_solved_prompts"] == len(solved)
        return result.rows

    everything, curriculum = collect(1.0), collect(0.2)
    share = {}
    for name, rows in (("all", everything), ("curriculum", curriculum)):
        prompts = {r.group_id: r for r in rows}.values()
        share[name] = sum(r.prompt_id in solved for r in prompts) / len(prompts)
        for r in rows:
            assert r.prompt_weight == (0.2 if name == "curriculum" and r.prompt_id in solved else 1.0)
    assert 0.4 < share["all"] < 0.6
    # solved prompts drawn at 0.2: about 0.2 / (0.2 + 1) of the groups
    assert share["curriculum"] == pytest.approx(0.2 / 1.2, abs=0.07)
