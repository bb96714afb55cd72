"""Trajectory rows from the ready pool's groups, and groups back from committed carry-over rows.

A row is a ``TrajectoryRow`` (storage/trajectories.py), the store's one record type. ``sample_row``
builds a ready group's samples and the carry-over; ``groups_from_carry`` turns a committed carry-over
back into the pool's groups, so the next round resumes them with every token's version and logprob intact.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from models.engines.types import GeneratedSample, GroupRequest, SamplingParams
from models.prompt import Prompt
from storage.trajectories import TrajectoryRow
from tasks.rollout.ready_pool import PARTIAL, VERIFIED, Group, Slot
from tasks.verifiers.outcome import Outcome, Verdict


@dataclass(frozen=True)
class Drawn:
    """A group's prompt and the probability the curriculum drew it with (recorded as prompt_weight)."""

    prompt: Prompt
    weight: float


def _utc(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, tz=UTC)


def _epoch(t: datetime | None) -> float | None:
    return None if t is None else t.timestamp()


def sample_row(group: Group, slot: Slot, context: dict, carried: bool = False) -> TrajectoryRow:
    """A ready group's sample, or (``carried``) one of the carry-over's.

    A carried sample's row has ``carry_state`` (partial | unverified | verified); a partial one holds
    its prefix and ``finish_reason='abort'``. Engine and verifier are the ones that finished it."""
    drawn: Drawn = group.meta
    prompt = drawn.prompt
    sample: GeneratedSample = slot.sample if slot.finished else slot.carried_partial
    verdict: Verdict | None = slot.verdict
    return TrajectoryRow(
        run_id=context["run_id"],
        round=context["round"],
        prompt_id=prompt.prompt_id,
        group_id=group.request.group_id,
        sample_index=slot.index,
        task=prompt.task,
        prompt_text=prompt.text,
        prompt_token_ids=list(group.request.prompt_token_ids),
        reference=prompt.reference,
        prompt_weight=drawn.weight,
        completion_text=slot.text,
        completion_token_ids=list(sample.token_ids),
        rollout_logprobs=list(sample.logprobs),
        token_policy_versions=list(sample.token_policy_versions),
        finish_reason=sample.finish_reason,
        engine=context["engine"],
        sampling=group.request.sampling.as_dict(),
        verifier=context["verifier"],
        reward=verdict.reward if verdict else None,
        outcome=verdict.outcome.value if verdict else None,
        verify_error=verdict.error if verdict else None,
        enqueued_at=_utc(group.enqueued_at),
        started_at=_utc(sample.started_at),
        finished_at=_utc(sample.finished_at),
        verified_at=_utc((slot.verified_at or sample.finished_at) if verdict else None),
        gen_latency_s=sample.gen_s,
        verify_latency_s=verdict.latency_s if verdict else None,
        carry_state=slot.state if carried else None,
    )


def groups_from_carry(rows: list[TrajectoryRow], stop: tuple[str, ...] = ()) -> list[Group]:
    """The ready pool's groups from a committed carry-over (rows as ``sample_row`` built them). ``stop``: the
    campaign's stop strings (rows do not record them; a resumed campaign has the same)."""
    by_group: dict[str, list[TrajectoryRow]] = {}
    for row in rows:
        by_group.setdefault(row.group_id, []).append(row)
    groups = []
    for group_id, members in by_group.items():
        members.sort(key=lambda r: r.sample_index)
        first = members[0]
        sp = first.sampling
        request = GroupRequest(
            group_id,
            tuple(first.prompt_token_ids),
            len(members),
            SamplingParams(sp["temperature"], sp["top_p"], sp["max_tokens"], sp["seed"], stop=stop),
        )
        prompt = Prompt(prompt_id=first.prompt_id, task=first.task, text=first.prompt_text, reference=first.reference)
        weight = first.prompt_weight  # None: written before the curriculum, which drew every prompt
        slots = []
        for row in members:
            sample = GeneratedSample(
                group_id=group_id,
                sample_index=row.sample_index,
                prompt_token_ids=request.prompt_token_ids,
                token_ids=list(row.completion_token_ids),
                logprobs=list(row.rollout_logprobs),
                token_policy_versions=list(row.token_policy_versions),
                finish_reason=row.finish_reason,
                started_at=_epoch(row.started_at),
                finished_at=_epoch(row.finished_at),
                gen_s=row.gen_latency_s or 0.0,
            )
            if row.carry_state == PARTIAL:
                slots.append(Slot(row.sample_index, carried_partial=sample))
                continue
            slot = Slot(row.sample_index, sample=sample, text=row.completion_text)
            if row.carry_state == VERIFIED:
                slot.verdict = Verdict(row.reward, Outcome(row.outcome), row.verify_error, row.verify_latency_s or 0.0)
                slot.verified_at = _epoch(row.verified_at)
            slots.append(slot)
        drawn = Drawn(prompt, 1.0 if weight is None else weight)
        groups.append(Group(request, prompt.reference, drawn, _epoch(first.enqueued_at), slots))
    return groups
