"""The champion gate: whether a round's evaluated checkpoint takes the ``champion`` alias.

A checkpoint takes the alias only when its serving accuracy is not below the champion's at the same
engine and dtype. A champion never scored there is scored first (the caller's ``champion_accuracy``,
tasks/evaluate/stage.py), so the comparison is always like with like; a champion of another promotion line
(another task or held-out set, the ``line`` tag) is never compared with, and the round fails naming
the fix. With ``evaluate.approval: required`` a checkpoint that passes is not promoted here: a person
decides (tasks/evaluate/approval.py). Replays and ``rlrounds eval`` never come here, so never move the alias.

The verdict is recorded on the model version, promotion last: a version carrying ``eval.promoted``
has been gated, and a resumed round reads the verdict back instead of gating again.
"""

from __future__ import annotations

from collections.abc import Callable

from storage.files import lease
from storage.model_versions import LineageError, parse_model_version
from storage.paths import StorageRoot
from storage.tracking import LINE_TAG, Tracker
from tasks.round.results import Evaluation, HeldOutScores

PROMOTED_TAG = "eval.promoted"  # written last: a version carrying it has been evaluated and gated
GATE_TAG = "eval.gate_passed"  # its accuracy was not below the champion's (promoted unless approval is required)


def champion_gate(
    tracker: Tracker,
    root: StorageRoot,
    model_version: str,
    scores: HeldOutScores,
    candidate_tags: dict[str, str],
    *,
    alias: str,
    approval_required: bool,
    champion_accuracy: Callable[[str], float],
) -> Evaluation:
    """Compare ``scores`` with the champion's, move ``alias`` to ``model_version`` when they are not
    below (and no person has to approve), and tag the verdict on the version.

    ``candidate_tags``: the version's tags before evaluation (its line); ``champion_accuracy``: the
    champion version's accuracy at the engine and dtype ``scores`` were measured with."""
    name, version = parse_model_version(model_version)
    # Read, compare and move the alias as one step: two campaigns of one line finishing together
    # would otherwise each compare with the old champion and the later write would win.
    with lease(root, root.lock(f"champion-{name}-{alias}")):
        champion = tracker.alias_version(name, alias)
        best = None
        if champion and champion != version:
            champion_tags = tracker.model_version(name, champion).tags
            check_same_line(name, alias, champion, champion_tags, candidate_tags)
            best = champion_accuracy(champion)
        passed = best is None or scores.accuracy >= best
        promoted = passed and not approval_required
        if promoted:
            tracker.set_alias(name, alias, version)
        tracker.tag_model_version(name, version, {PROMOTED_TAG: float(promoted), GATE_TAG: float(passed)})
    return Evaluation(**scores.model_dump(), champion_accuracy=best, promoted=promoted, gate_passed=passed)


def recorded_verdict(tags: dict[str, str]) -> dict[str, bool]:
    """The verdict tagged on a gated version, as ``Evaluation`` fields (``promoted``, ``gate_passed``)."""
    promoted = bool(float(tags[PROMOTED_TAG]))
    # a version gated before the gate's own tag was written passed exactly when it was promoted
    passed = bool(float(tags[GATE_TAG])) if GATE_TAG in tags else promoted
    return {"promoted": promoted, "gate_passed": passed}


def other_line(champion_tags: dict[str, str], candidate_tags: dict[str, str]) -> str | None:
    """The champion's line when it differs from the candidate's, else None. A version registered before
    lines were recorded has none and is taken to be of the candidate's line (there is nothing to tell)."""
    theirs, ours = champion_tags.get(LINE_TAG), candidate_tags.get(LINE_TAG)
    return theirs if theirs and ours and theirs != ours else None


def check_same_line(name: str, alias: str, champion: str, champion_tags: dict, candidate_tags: dict) -> None:
    """Refuse to gate a checkpoint against a champion of another line: their accuracies were measured on
    other tasks or held-out sets, so comparing them would move the alias on a meaningless difference."""
    theirs = other_line(champion_tags, candidate_tags)
    if theirs is not None:
        ours = candidate_tags[LINE_TAG]
        raise LineageError(
            f"the {alias} of {name} is version {champion}, of promotion line {theirs!r}, but this checkpoint is of "
            f"line {ours!r}: a gate compares only checkpoints of one task and held-out set; leave "
            f"publish.model_name unset (each line gets its own registered model, rlrounds-{ours}) or give this "
            "line a model name of its own"
        )
