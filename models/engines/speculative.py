"""Speculative rollout: drafts from earlier completions, verified so that every sample is plain sampling's.

RL rollout samples the same prompts round after round from a policy that moves a little each round, so
what the policy wrote before is a good guess at what it writes next. A sample in flight follows a
*reference*, an earlier completion that agrees with what it has generated so far, and the engine feeds
up to ``k`` of the reference's next tokens with the sample's last token in one forward pass
(``SlotCache.verify``). References come from a ``DraftIndex``:

- the same prompt's earlier completions (the campaign's last committed rounds, read from the trajectory
  store, and the samples of this round that already finished, its siblings among them): a reference
  whose prefix is exactly what the sample generated;
- failing that, a completion of the history whose tokens before some position equal the sample's last
  tokens (prompt included), longest match first: completions of other prompts share much of their text on
  tasks with structure, which a prompt's own history, seldom repeated, cannot supply.

The acceptance rule. Plain sampling draws the token at position ``t`` of a sample by Gumbel-max: the
argmax over the vocabulary of processed logprob + noise, the noise a hash of (sample seed, t, token)
(``embedded.sample_tokens``). Verification computes, for every fed position, the token plain sampling
would draw there given the prefix up to it (the drafts before it included), with that same noise. A draft
is accepted when it *is* that token; at the first position where it is not, the token plain sampling
draws there is emitted and the rest of the draft is dropped (``accepted_tokens``). Every emitted token is
therefore the token plain sampling emits from the same prefix with the same seed: a sample generated
without interruption is the one the engine produces without speculation, so its distribution is plain
sampling's at any temperature and top_p, its recorded logprobs are the current policy's, and drafts never
change a row. Two things can differ: verification attends over several new tokens at once, which can move
the last float bits of a logit and so flip a draw that sits on a tie within ~1e-6; and a partial rollout
stops at a decode step, where speculative samples have advanced by other amounts (docs/engines.md).

What that rule accepts. A draft token ``d`` is accepted with probability ``p(d)``, the policy's
probability of it (the Gumbel-max argmax is ``d`` with exactly that probability), and the token drawn at
the first rejection is distributed as ``p`` without ``d``, renormalised: the classic speculative-sampling
rule for a draft that is a fixed token (accept with ``min(1, p(d) / q(d))``, ``q`` a point mass at ``d``;
resample from ``max(0, p - q)``), here coupled to the plain sample's noise. The stored completions carry
the behaviour logprob of each token, and a rule accepting with ``min(1, p(d) / q_old(d))`` accepts more
where the policy moved little, but it is exact only for a draft that is a fresh sample of the old policy
from the same context, and its rejection step draws from ``max(0, p - q_old)``, which needs the old
policy's whole distribution at that position (a forward pass of the old checkpoint). A reference chosen
because it matches what the sample wrote is not such a sample, so that rule is not used; the stored
probabilities only decide how long a draft is (``Follow.draft``), which changes no token.

A verification step costs what its tokens do where a step is compute-bound (a CPU, a saturated GPU), and
about what one token does where it is overhead-bound (a small batch on any device, the long tail).
``step_tokens`` bounds the tokens a step feeds; a sample's draft shrinks to what was accepted after a
rejection and doubles after a full acceptance, up to ``k``.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

MAX_MATCH = 8
"""The longest context a suffix lookup tries first (then one token shorter, down to ``match``)."""


@dataclass(frozen=True)
class Speculation:
    """How a generate call speculates: ``k`` drafted tokens at most per sample and step, ``step_tokens`` fed
    tokens at most per step (rows plus drafts), references from ``index``."""

    index: DraftIndex
    k: int = 4
    step_tokens: int = 64
    min_probability: float = 0.0  # Follow.draft: where a draft is cut by its reference's own probabilities


@dataclass
class SpeculationStats:
    """Counts since the engine was made; a stage reports the difference over its calls (``minus``)."""

    verify_steps: int = 0  # decode steps that fed at least one drafted token
    drafted: int = 0  # drafted tokens fed to verification
    accepted: int = 0  # drafted tokens that were the policy's own draw
    drafting_rows: int = 0  # (row, step) pairs that carried a draft
    emitted: int = 0  # tokens those rows emitted (accepted + the draw at the first rejection, or the bonus)
    draft_s: float = 0.0  # seconds choosing drafts

    def minus(self, before: SpeculationStats) -> SpeculationStats:
        return SpeculationStats(**{k: getattr(self, k) - getattr(before, k) for k in self.__dataclass_fields__})

    def copy(self) -> SpeculationStats:
        return self.minus(SpeculationStats())


@runtime_checkable
class Speculator(Protocol):
    """An engine that can draft from a ``DraftIndex`` and verify the drafts losslessly (the embedded engine
    on its slot cache)."""

    speculation_stats: SpeculationStats

    def speculate(self, speculation: Speculation | None) -> str | None:
        """Draft in the next ``generate`` calls (None: stop); returns why it cannot, or None if it will."""
        ...


Tokens = tuple[int, ...]


@dataclass
class Follow:
    """A sample's place in its reference: ``reference[position:]`` is what it would write next, and
    ``logprobs[i]`` the behaviour logprob ``reference[i]`` was sampled with (0.0 where unknown: the prompt)."""

    reference: Tokens
    position: int
    logprobs: tuple[float, ...] = ()

    def draft(self, most: int, min_probability: float) -> list[int]:
        """Up to ``most`` next tokens of the reference, cut where the probability the reference's own policy gave
        the tokens so far (their product) falls below ``min_probability``: a draft token the current policy is
        unlikely to draw costs a fed position and is likely rejected, with everything after it."""
        end = min(self.position + most, len(self.reference))
        if min_probability > 0 and self.logprobs:
            floor, total = math.log(min_probability), 0.0
            for at in range(self.position, end):
                total += self.logprobs[at]
                if total < floor:
                    end = at
                    break
        return list(self.reference[self.position : end])


@dataclass
class DraftIndex:
    """Earlier completions, for drafting: by prompt, and by the runs of ``sizes`` tokens before each of their
    positions (``match_sizes(match)``).

    Adding a completion costs a dictionary entry per token and context length; ``max_tokens`` bounds the
    tokens held (once reached, later completions are not added: the history is read newest first).
    ``indexed_tokens`` and ``index_s`` say what it cost."""

    match: int = 3
    max_tokens: int = 1_000_000
    per_prompt: int = 8  # completions kept per prompt, newest first
    by_prompt: dict[Tokens, list[Follow]] = field(default_factory=dict)
    by_context: dict[Tokens, tuple[Tokens, int, tuple[float, ...]]] = field(default_factory=dict)  # as Follow's fields
    indexed_tokens: int = 0
    index_s: float = 0.0  # seconds spent adding completions
    history_s: float = 0.0  # seconds the stage spent reading and indexing the history it started from
    sizes: tuple[int, ...] = field(init=False)  # the context lengths indexed, longest first

    def __post_init__(self) -> None:
        self.sizes = match_sizes(self.match)

    def add(
        self,
        prompt: Sequence[int],
        completion: Sequence[int],
        logprobs: Sequence[float] | None = None,
        newest: bool = True,
        contexts: bool = True,
    ) -> None:
        """Index ``completion`` of ``prompt`` (``logprobs``: its tokens' behaviour logprobs, when known).
        ``newest``: it is preferred over the references held (a sample of this round); False: the others are
        preferred (history read newest round first). ``contexts``: also by its contexts (a dictionary entry per token
        and match length), not only as a completion of its prompt (one entry)."""
        if not completion or self.indexed_tokens >= self.max_tokens:
            return
        began = time.perf_counter()
        prompt, completion = tuple(prompt), tuple(completion)
        full = prompt + completion
        known = tuple(logprobs) if logprobs is not None and len(logprobs) == len(completion) else ()
        reference = Follow(full, len(prompt), (0.0,) * len(prompt) + known if known else ())
        refs = self.by_prompt.setdefault(prompt, [])
        if all(r.reference != full for r in refs):
            if newest:
                refs.insert(0, reference)
                del refs[self.per_prompt :]
            elif len(refs) < self.per_prompt:
                refs.append(reference)
        if contexts:
            by_context = self.by_context
            for at in range(len(prompt), len(full)):
                for n in self.sizes:
                    if n > at:
                        continue
                    key = full[at - n : at]
                    if newest or key not in by_context:
                        by_context[key] = (full, at, reference.logprobs)
        self.indexed_tokens += len(completion)
        self.index_s += time.perf_counter() - began

    def add_all(self, completions: Iterable[tuple[Sequence[int], Sequence[int], Sequence[float] | None]]) -> None:
        """History, newest first: each (prompt, completion, logprobs) is preferred over those after it. The
        cyclic garbage collector is paused meanwhile: the index is hundreds of thousands of new tuples, none
        garbage, and collections triggered by their allocation scanned them again and again (a build took
        several times its usual seconds, at random)."""
        paused = gc.isenabled()
        gc.disable()
        try:
            for prompt, completion, logprobs in completions:
                self.add(prompt, completion, logprobs, newest=False)
        finally:
            if paused:
                gc.enable()

    def find(self, prompt: Tokens, generated: Sequence[int]) -> Follow | None:
        """A reference for a sample of ``prompt`` that generated ``generated`` so far: a completion of the same
        prompt that starts with it, else the newest completion with the longest matching context."""
        n = len(prompt)
        written = len(generated)
        for ref in self.by_prompt.get(prompt, ()):
            if len(ref.reference) > n + written and ref.reference[n : n + written] == tuple(generated):
                return Follow(ref.reference, n + written, ref.logprobs)
        tail = (
            tuple(prompt[-MAX_MATCH:]) + tuple(generated[-MAX_MATCH:])
            if written < MAX_MATCH
            else tuple(generated[-MAX_MATCH:])
        )
        for size in self.sizes:
            if size > len(tail):
                continue
            hit = self.by_context.get(tail[len(tail) - size :])
            if hit is not None:
                return Follow(*hit)
        return None


def match_sizes(match: int) -> tuple[int, ...]:
    """The context lengths an index keys completions by, longest first: ``MAX_MATCH``, then every other length down
    to ``match`` (each length costs a dictionary entry per indexed token)."""
    return tuple(sorted({*range(MAX_MATCH, match - 1, -2), match}, reverse=True))


def accepted_tokens(draws: Sequence[int], draft: Sequence[int]) -> list[int]:
    """The tokens a sample emits from one verification step: ``draws[j]`` is plain sampling's draw at the j-th
    position it fed (its last token, then ``draft``), given the prefix with the drafts before it. The drafts that
    are those draws, then the draw at the first that is not (or the one after the last draft): the acceptance
    rule of the module doc."""
    emitted: list[int] = []
    for j, token in enumerate(draws[: len(draft) + 1]):
        emitted.append(token)
        if j == len(draft) or token != draft[j]:
            break
    return emitted


def follow_on(follow: Follow | None, emitted: Sequence[int]) -> Follow | None:
    """The place after ``emitted`` new tokens, if the reference wrote them too; else None (look again)."""
    if follow is None:
        return None
    end = follow.position + len(emitted)
    if end < len(follow.reference) and follow.reference[follow.position : end] == tuple(emitted):
        follow.position = end
        return follow
    return None
