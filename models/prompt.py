"""A training or held-out prompt: the unit every task, recipe and stage passes around."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    """One prompt: its stable id, the task it belongs to, the text fed to the policy and the reference
    answer (or tests) a verifier scores a completion against."""

    prompt_id: str
    task: str
    text: str
    reference: str
