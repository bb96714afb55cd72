"""A curriculum from the campaign's own history: prompts that every sample solved lately are drawn less.

Late in a campaign many groups are solved by all their samples. Such a group has zero advantage, so
filter drops it after its generation was paid for. A prompt's most recent group predicts its next one:
on the default task, a prompt whose last group was solved by every sample was solved by every sample
again far more often than the other prompts were (docs/performance.md). So a prompt that every
sample of its most recent group solved, within the campaign's last ``prompts.history_rounds``
committed trajectory versions, is admitted with probability ``prompts.solved_weight``, and the others
always are.

The inputs are committed versions only, and the draw is a hash of (round seed, position in the
prompt stream). So a round generated again (a resumed crash) draws the same prompts. Every row
records the probability its prompt was admitted with (``prompt_weight``), so what training saw stays
auditable, and a replay trains on the stored rows as they are.
"""

from __future__ import annotations

import hashlib

from storage.paths import StorageRoot
from storage.trajectories import committed_round_version, read_table
from tasks.verifiers.outcome import Outcome


def solved_prompts(root: StorageRoot, run_id: str, round_index: int, history_rounds: int) -> frozenset[str]:
    """Prompt ids whose most recent group in the last ``history_rounds`` committed versions of the
    campaign (rounds before ``round_index``) had every sample succeed."""
    latest: dict[str, bool] = {}
    for past in range(max(1, round_index - history_rounds), round_index):
        version = committed_round_version(root, run_id, past)
        if version is None:  # not committed (or another campaign shape): no evidence
            continue
        latest.update(_latest_outcomes(root, version))
    return frozenset(p for p, s in latest.items() if s)


_OUTCOMES: dict[tuple[str, str], dict[str, bool]] = {}
"""Per committed version (root URI, content-addressed id): prompt id -> solved. A version never
changes, so a campaign's process reads each round's outcomes once, not once per later round."""


def _latest_outcomes(root: StorageRoot, version) -> dict[str, bool]:
    key = (root.uri, version.version)
    if key not in _OUTCOMES:
        table = read_table(root, version, columns=["prompt_id", "group_id", "outcome"])
        solved: dict[str, bool] = {}
        prompt_of: dict[str, str] = {}
        for prompt_id, group_id, outcome in zip(
            *(table.column(c).to_pylist() for c in ("prompt_id", "group_id", "outcome"))
        ):
            prompt_of[group_id] = prompt_id
            solved[group_id] = solved.get(group_id, True) and outcome == Outcome.SUCCESS.value
        # groups in stored order: a prompt's latest group in the version wins
        _OUTCOMES[key] = {prompt_id: solved[group_id] for group_id, prompt_id in prompt_of.items()}
        while len(_OUTCOMES) > 256:  # bounded: the oldest entries go first
            del _OUTCOMES[next(iter(_OUTCOMES))]
    return _OUTCOMES[key]


def admitted(seed: int, position: int, weight: float) -> bool:
    """A seeded draw with probability ``weight`` for the prompt at ``position`` of a round's stream."""
    if weight >= 1.0:
        return True
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < weight
