"""Greedy answers from any engine: the one loop the evaluation stage and the base recipe share.

How an answer is scored is the caller's (the evaluation stage's verifier, the base recipe's exact match).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from models.engines.types import GroupRequest, RolloutEngine, SamplingParams
from models.prompt import Prompt, prompt_encodings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def greedy_completions(
    engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt], max_tokens: int
) -> Iterator[tuple[Prompt, str, int]]:
    """(prompt, decoded completion, completion tokens) of each prompt's one greedy sample, in finish order."""
    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=max_tokens, seed=0)
    encode = prompt_encodings(tokenizer)  # the held-out set, every round
    requests = [GroupRequest(p.prompt_id, encode(p)[1], 1, params) for p in prompts]
    by_id = {p.prompt_id: p for p in prompts}
    for sample in engine.generate(requests):
        yield (
            by_id[sample.group_id],
            tokenizer.decode(sample.token_ids, skip_special_tokens=True),
            len(sample.token_ids),
        )
