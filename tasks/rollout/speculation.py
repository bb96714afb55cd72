"""Speculative rollout in the rollout stage: the draft index from the campaign's history, and its figures.

The index holds the completions of the campaign's last ``rollout.speculative.history_rounds`` committed
trajectory versions (rounds before this one), newest round first, and the engine adds this round's samples
as they finish (models/engines/speculative.py). Only committed versions are read, so a round generated again
(a resumed crash) or a replay drafts from the same history; and since every emitted token is plain sampling's
own draw, the drafts change how fast a row is generated, not the row.
"""

from __future__ import annotations

import time

from models.engines.speculative import DraftIndex, Speculation, SpeculationStats, Speculator
from models.engines.types import RolloutEngine
from storage.paths import StorageRoot
from storage.trajectories import committed_round_version, read_table
from tasks.config.rollout import SpeculativeConfig


def history(
    root: StorageRoot, run_id: str, round_index: int, rounds: int
) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, completion ids, behaviour logprobs) of the campaign's committed rows in the ``rounds`` rounds
    before ``round_index``, newest round first, each round in stored order."""
    columns = ["prompt_token_ids", "completion_token_ids", "rollout_logprobs"]
    found: list[tuple[list[int], list[int], list[float]]] = []
    for past in range(round_index - 1, max(0, round_index - 1 - rounds), -1):
        version = committed_round_version(root, run_id, past)
        if version is None:  # not committed (or another campaign shape): nothing to draft from
            continue
        table = read_table(root, version, columns=columns)
        found.extend(zip(*(table.column(c).to_pylist() for c in columns)))
    return found


def start_speculation(
    engine: RolloutEngine, settings: SpeculativeConfig, root: StorageRoot, run_id: str, round_index: int
) -> tuple[DraftIndex | None, str | None]:
    """Turn speculation on for this round's rollout: (the index, None), or (None, why not) when the engine
    cannot verify drafts (vLLM, Ray replicas, a model the slot cache does not serve). Off: (None, None)."""
    if not settings.enabled:
        if isinstance(engine, Speculator):
            engine.speculate(None)
        return None, None
    if not isinstance(engine, Speculator):
        return None, f"the {engine.info.name} engine does not draft from the trajectory store (docs/engines.md)"
    index = DraftIndex(match=settings.match_tokens, max_tokens=settings.max_index_tokens)
    began = time.perf_counter()
    index.add_all(history(root, run_id, round_index, settings.history_rounds) if settings.history_rounds else [])
    index.history_s = time.perf_counter() - began
    why_not = engine.speculate(Speculation(index, settings.k, settings.step_tokens, settings.min_probability))
    return (None, why_not) if why_not else (index, None)


class RoundSpeculation:
    """One rollout's speculation: on from construction (``why_not`` says why it is not, where it cannot be) until
    ``finish``, which turns it off (evaluation and publish share the engine and sample plainly) and returns the
    rollout's figures (``figures``): its decode steps, and what speculation did in them. As a context manager it
    finishes on leaving the block, however the block ends:

        with RoundSpeculation(engine, settings, root, run_id, round_index) as speculation:
            result = collection.collect(...)
        stats.update(speculation.figures)"""

    def __init__(
        self, engine: RolloutEngine, settings: SpeculativeConfig, root: StorageRoot, run_id: str, round_index: int
    ):
        self.engine = engine
        self.index, self.why_not = start_speculation(engine, settings, root, run_id, round_index)
        self._steps = engine.decode_steps
        self._used = engine.speculation_stats.copy() if self.index is not None else None

    def finish(self) -> dict[str, float]:
        used = None
        if self.index is not None:
            self.engine.speculate(None)
            used = self.engine.speculation_stats.minus(self._used)
        self.figures = speculation_figures(self.index, used, self.engine.decode_steps - self._steps, self.why_not)
        return self.figures

    def __enter__(self) -> RoundSpeculation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()  # however the rollout ends: the live engine is shared, and later stages sample plainly


def speculation_figures(
    index: DraftIndex | None, used: SpeculationStats | None, decode_steps: int, why_not: str | None
) -> dict[str, float]:
    """The round's speculative-rollout figures, for the health report and MLflow (``rollout/spec_*``)."""
    figures = {
        "rollout/decode_steps": decode_steps,
        "rollout/speculative": float(index is not None),
        "rollout/speculative_unavailable": float(why_not is not None),
    }
    if index is None or used is None:
        return figures
    return {
        **figures,
        "rollout/spec_acceptance": used.accepted / max(used.drafted, 1),
        "rollout/spec_tokens_per_verify_step": used.emitted / max(used.drafting_rows, 1),
        # what verification costs where a step costs what its tokens do: tokens fed per token emitted
        "rollout/spec_fed_per_emitted": (used.drafting_rows + used.drafted) / max(used.emitted, 1),
        "rollout/spec_verify_steps": used.verify_steps,
        "rollout/spec_drafted_tokens": used.drafted,
        "rollout/spec_accepted_tokens": used.accepted,
        "rollout/spec_draft_s": used.draft_s,
        "rollout/spec_index_s": index.index_s,
        "rollout/spec_history_s": index.history_s,
        "rollout/spec_indexed_tokens": index.indexed_tokens,
    }
