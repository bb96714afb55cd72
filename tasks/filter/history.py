"""A prompt's success rate in the campaign's history: a baseline for groups that all scored the same.

A group whose samples all scored the same has no advantage within it, and GRPO drops it after its generation
was paid for. Its prompt's earlier groups say how often the policy solved it lately; with that rate ``p`` as the
baseline, a group all right on a prompt solved at ``p`` < 1 still says "these answers are better than usual"
(advantage ``1 - p``), one all wrong on a prompt solved at ``p`` > 0 the opposite (``-p``). The baseline does
not depend on the group's own samples, so the policy gradient stays unbiased; it is only noisier than a
group's mean (filter.history_baseline_rounds, docs/training.md). ``filter/kept_uniform_groups`` counts the
groups a round trained this way.

The inputs are committed versions before the round only, so the rates are the same whenever the round is
filtered again (a resumed crash, a refilter): they are a function of the store.
"""

from __future__ import annotations

from collections.abc import Mapping

from storage.paths import StorageRoot
from storage.trajectories import committed_round_version, read_table
from tasks.verifiers.outcome import Outcome

_SCORED = (Outcome.SUCCESS.value, Outcome.MODEL_FAILURE.value)

_TALLIES: dict[tuple[str, str], dict[str, tuple[float, int]]] = {}
"""Per committed version (root URI, content-addressed id): prompt id -> (summed reward, scored samples). A
version never changes, so a campaign's process reads each round's rewards once."""


def prompt_success(root: StorageRoot, run_id: str, round_index: int, rounds: int) -> dict[str, tuple[float, int]]:
    """Prompt id -> (mean reward, scored samples) over the campaign's last ``rounds`` committed versions before
    ``round_index``. Infrastructure failures and unscored samples do not count."""
    summed: dict[str, list] = {}
    for past in range(max(1, round_index - rounds), round_index):
        version = committed_round_version(root, run_id, past)
        if version is None:  # not committed (or another campaign shape): no evidence
            continue
        for prompt_id, (total, count) in _tallies(root, version).items():
            entry = summed.setdefault(prompt_id, [0.0, 0])
            entry[0] += total
            entry[1] += count
    return {prompt_id: (total / count, count) for prompt_id, (total, count) in summed.items()}


MIN_SAMPLES = 4
"""Fewest scored samples of a prompt in the history window for its rate to be a baseline (a default group)."""


def history_baselines(
    root: StorageRoot, run_id: str, round_index: int, rounds: int | None
) -> Mapping[str, float] | None:
    """The baselines ``filter.decide`` takes: prompt id -> mean reward, for prompts with at least ``MIN_SAMPLES``
    scored samples in the campaign's last ``rounds`` committed rounds before ``round_index``. None when ``rounds``
    is None (filter.history_baseline_rounds off)."""
    if rounds is None:
        return None
    rates = prompt_success(root, run_id, round_index, rounds)
    return {prompt_id: mean for prompt_id, (mean, count) in rates.items() if count >= MIN_SAMPLES}


def _tallies(root: StorageRoot, version) -> dict[str, tuple[float, int]]:
    key = (root.uri, version.version)
    if key not in _TALLIES:
        table = read_table(root, version, columns=["prompt_id", "reward", "outcome"])
        tallies: dict[str, tuple[float, int]] = {}
        for prompt_id, reward, outcome in zip(
            *(table.column(c).to_pylist() for c in ("prompt_id", "reward", "outcome"))
        ):
            if reward is None or outcome not in _SCORED:
                continue
            total, count = tallies.get(prompt_id, (0.0, 0))
            tallies[prompt_id] = (total + reward, count + 1)
        _TALLIES[key] = tallies
        while len(_TALLIES) > 256:  # bounded: the oldest entries go first
            del _TALLIES[next(iter(_TALLIES))]
    return _TALLIES[key]
