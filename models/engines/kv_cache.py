"""The embedded engine's KV caches: the running batch's keys and values, as sequences join and leave it.

Both kinds answer the same calls, which is all the engine's decode loop (models/engines/embedded.py) asks:

    admit(inputs, owner, width) -> logits [n, V]   prefill the distinct inputs once, one row per owner
    step(tokens)                -> logits [A, V]   feed one token to each of the A live rows
    retire(keep)                -> order           keep these rows; order[i] is the old row now at i
    sort_rows()                 -> order | None    rows longest first again, where that pays (slots only)
    clear()                                        drop every row (new weights: the rows are prefilled again)
    live                                           rows held

``SlotCache`` (Llama-family models, the default wherever it applies): each layer's keys and values
live in one preallocated buffer [slots, width, kv_heads, head_dim]. A sequence owns a slot and holds
its tokens at positions 0..n-1 of it, unpadded; a decode step writes one column per row in place.
The live rows are always slots 0..A-1: when some finish, the last live rows move into the holes (a
copy of the moved rows only) and joining rows take the slots after A. The forward calls the model's
own modules (embeddings, norms, projections, MLP, rotary table), so the weights loaded into the
model are the weights served; only attention over the slot buffer is written here.

Both live on the model's device: every tensor they make is made there, and token ids go over in one copy
per prefill.

``PaddedCache`` (any other causal LM): transformers' own cache and forward, left-padded. Every
decode step grows each layer's cache by one column (a copy of the whole cache), and every join or
leave copies the whole batch's cache. On the default task's rollout that bookkeeping was a large share
of the stage (docs/performance.md); ``benchmarks/engine.py`` compares the two.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from models.logprobs import cache_argument, cache_of, length_chunks

SLOT_ARCHITECTURES = ("llama", "qwen2")
"""Model types whose decoder layer is the one SlotCache reproduces (pre-norm attention and MLP,
rotary positions, optional grouped-query heads, q/k/v/o projections with or without bias)."""

SLOT_ROPE_TYPES = ("default", "linear", "llama3")
"""Rotary variants whose table depends on the position only (not on the sequence length seen)."""

SLOT_BUDGET_BYTES = 2 << 30
"""The most memory a slot cache may preallocate; beyond it (long contexts x many slots) the padded
cache, which holds only what the live rows use, is the better trade."""


def slot_cache_applies(model: Any, slots: int, width: int) -> str | None:
    """None if ``SlotCache`` can serve this model for ``slots`` rows of up to ``width`` positions, else
    the reason it cannot."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SLOT_ARCHITECTURES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {SLOT_ARCHITECTURES}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SLOT_ROPE_TYPES:
        return f"rotary type {rope_type!r} depends on the sequence length"
    if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "pretraining_tp", 1) != 1:
        return "sliding-window attention or tensor-parallel pretraining layers"
    needed = slot_bytes(model, slots, width)
    if needed > SLOT_BUDGET_BYTES:
        return f"{slots} slots x {width} positions need {needed / 2**30:.1f} GiB of cache"
    return None


def slot_bytes(model: Any, slots: int, width: int) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    element = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * slots * cfg.num_key_value_heads * width * head_dim * element


def distinct_inputs(inputs: list[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """(distinct inputs, the index of each input's distinct row): identical inputs prefill once."""
    index: dict[tuple[int, ...], int] = {}
    owner = [index.setdefault(x, len(index)) for x in inputs]
    return list(index), owner


class SlotCache:
    """Preallocated per-slot keys and values and a decode written against them (module doc)."""

    def __init__(self, model: Any, slots: int, pad_token_id: int):
        cfg = model.config
        self.model = model
        self.slots = slots
        self.pad_token_id = pad_token_id
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = model.model.layers[0].self_attn.scaling
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.width = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths = torch.zeros(slots, dtype=torch.long, device=self.device)  # tokens held per slot
        self.live = 0

    def _reserve(self, width: int) -> None:
        """Room for ``width`` positions per slot; grows (rarely: to the longest input + max_tokens) by copy."""
        if width <= self.width:
            return
        width = -(-width // 8) * 8
        shape = (self.slots, width, self.kv_heads, self.head_dim)
        layers = len(self.model.model.layers)
        grown = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2 * layers)]
        for old, new in zip(self.keys + self.values, grown):
            new[: self.live, : self.width] = old[: self.live]
        self.keys, self.values = grown[:layers], grown[layers:]
        positions = torch.arange(width, device=self.device).unsqueeze(0)
        cos, sin = self.model.model.rotary_emb(torch.zeros(1, dtype=self.dtype, device=self.device), positions)
        self.cos, self.sin = cos[0], sin[0]  # [width, head_dim]
        self.width = width

    def admit(self, inputs: list[tuple[int, ...]], owner: list[int], width: int) -> torch.Tensor:
        """Prefill ``inputs`` (distinct token sequences) into new slots A..A+n-1, slot A+i continuing
        ``inputs[owner[i]]``; room is reserved for ``width`` positions. Logits [n, V] for each row's next token.

        Inputs prefill in chunks of similar length (``PREFILL_PADDING_BUDGET``): resumed samples carry
        prefixes of every length, and one long prefix would pad every joining row up to it."""
        n = len(owner)
        if self.live + n > self.slots:
            raise ValueError(f"{self.live} live rows + {n} joining exceed {self.slots} slots")
        self._reserve(width)
        lengths = torch.tensor([len(x) for x in inputs], device=self.device)
        rows = torch.tensor(owner, device=self.device)  # [n] the distinct input each joining row continues
        logits = None
        for chunk in length_chunks(lengths, PREFILL_PADDING_BUDGET):
            local = torch.full((len(inputs),), -1, dtype=torch.long, device=self.device)
            local[chunk] = torch.arange(len(chunk), device=self.device)
            joining = torch.nonzero(local[rows] >= 0).squeeze(1)  # the joining rows this chunk feeds
            chunk_inputs = [inputs[i] for i in chunk.tolist()]
            part = self._prefill(chunk_inputs, lengths[chunk], local[rows[joining]], self.live + joining)
            if logits is None:
                logits = part.new_empty((len(inputs), part.shape[-1]))
            logits[chunk] = part
        self.lengths[self.live : self.live + n] = lengths[rows]
        self.live += n
        return logits[rows]

    def _prefill(
        self, inputs: list[tuple[int, ...]], lengths: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Run ``inputs`` (of ``lengths``) right-padded to the longest; slot ``slots[i]`` takes the keys and
        values of input ``rows[i]``. Logits [len(inputs), V] for each input's next token."""
        span = int(lengths.max())
        ids = torch.tensor([[*x, *[self.pad_token_id] * (span - len(x))] for x in inputs], device=self.device)
        # query i sees keys j <= i of its own input; right padding sits after every real key
        keys_seen = torch.arange(span, device=self.device)
        mask = (keys_seen <= keys_seen.unsqueeze(-1)) & (keys_seen < lengths.view(-1, 1, 1))  # [D, span, span]
        hidden = self.model.model.embed_tokens(ids)  # [D, span, hidden]
        cos, sin = self.cos[:span].unsqueeze(1), self.sin[:span].unsqueeze(1)  # [span, 1, head_dim]
        for layer, keys, values in zip(self.model.model.layers, self.keys, self.values):
            q, k, v = self._project(layer, hidden, cos, sin)  # [D, span, heads, head_dim]
            keys[slots, :span] = k[rows]
            values[slots, :span] = v[rows]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=mask.unsqueeze(1),
                scale=self.scale,
                enable_gqa=self.kv_heads != self.heads,
            ).transpose(1, 2)  # [D, span, heads, head_dim]
            hidden = self._finish_layer(layer, hidden, out)
        last = hidden[torch.arange(len(inputs), device=self.device), lengths - 1]  # [D, hidden]
        return self._logits(last)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` [A] (one per live row, in slot order); logits [A, V] for the token after."""
        live = self.live
        positions = self.lengths[:live]
        # Runs of contiguous rows, each attending over the keys of its own longest row: rows are kept in
        # order of length, so one run-on row does not make every row of the batch pay for its length.
        runs = attention_runs(positions)
        # each run's mask [rows, keys]: True where a key is not the row's
        masks = [torch.arange(keys, device=self.device) > positions[a:b].unsqueeze(-1) for a, b, keys in runs]
        at = torch.arange(live, device=self.device) * self.width + positions  # each row's new column, flattened
        hidden = self.model.model.embed_tokens(tokens).unsqueeze(1)  # [A, 1, hidden]
        cos, sin = self.cos[positions].view(live, 1, 1, -1), self.sin[positions].view(live, 1, 1, -1)
        for layer, keys, values in zip(self.model.model.layers, self.keys, self.values):
            q, k, v = self._project(layer, hidden, cos, sin)  # [A, 1, heads, head_dim]
            keys.view(-1, self.kv_heads, self.head_dim).index_copy_(0, at, k[:, 0])
            values.view(-1, self.kv_heads, self.head_dim).index_copy_(0, at, v[:, 0])
            parts = [
                self._attend_one(q[a:b], keys[a:b, :span], values[a:b, :span], mask)
                for (a, b, span), mask in zip(runs, masks)
            ]
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
            hidden = self._finish_layer(layer, hidden, out)
        self.lengths[:live] += 1
        return self._logits(hidden[:, 0])

    def verify(self, tokens: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """Feed several tokens to some rows in one pass: packed ``tokens`` [N], token i going to live row
        ``rows[i]`` at ``steps[i]`` past that row's held tokens (each row's steps 0, 1, ...: its last sampled
        token, then its drafts; every live row feeds at least step 0). Logits [N, V], token i's next-token
        distribution given its row's tokens up to and including it. The rows' lengths do not move:
        ``advance`` keeps the tokens that were accepted, and the keys of the others are overwritten later
        (a query never sees keys past its own position).

        Projections and MLP run on the N real tokens only; attention runs on each row's queries padded to the
        longest row's, over its own keys (models/engines/speculative.py)."""
        live = self.live
        fed = int(steps.max()) + 1
        base = self.lengths[:live]
        counts = torch.bincount(rows, minlength=live)  # tokens each row feeds
        self._reserve(int((base + counts).max()))
        positions = base[rows] + steps  # [N]
        at = rows * self.width + positions
        padded_at = rows * fed + steps  # each token's place in [live, fed]
        runs = attention_runs(base + counts - 1)  # each row attends up to its own last token
        query_at = base.unsqueeze(-1) + torch.arange(fed, device=self.device)  # [live, fed] each query's position
        masks = [torch.arange(keys, device=self.device) > query_at[a:b].unsqueeze(-1) for a, b, keys in runs]
        hidden = self.model.model.embed_tokens(tokens).unsqueeze(0)  # [1, N, hidden]
        cos, sin = self.cos[positions].view(1, -1, 1, self.head_dim), self.sin[positions].view(1, -1, 1, self.head_dim)
        for layer, keys, values in zip(self.model.model.layers, self.keys, self.values):
            q, k, v = self._project(layer, hidden, cos, sin)  # [1, N, heads, head_dim]
            keys.view(-1, self.kv_heads, self.head_dim).index_copy_(0, at, k[0])
            values.view(-1, self.kv_heads, self.head_dim).index_copy_(0, at, v[0])
            queries = q.new_zeros((live * fed, self.heads, self.head_dim)).index_copy_(0, padded_at, q[0])
            queries = queries.view(live, fed, self.heads, self.head_dim)
            parts = [
                self._attend_many(queries[a:b], keys[a:b, :span], values[a:b, :span], mask)
                for (a, b, span), mask in zip(runs, masks)
            ]
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
            out = out.reshape(live * fed, self.heads, self.head_dim).index_select(0, padded_at)
            hidden = self._finish_layer(layer, hidden, out.unsqueeze(0))
        return self._logits(hidden[0])

    def advance(self, kept: torch.Tensor) -> None:
        """After ``verify``: each live row keeps ``kept[row]`` of the tokens it fed (its last token and the
        drafts accepted); the rest are rolled back."""
        self.lengths[: self.live] += kept

    def _attend_many(self, q, keys, values, hidden_mask) -> torch.Tensor:
        """Several queries per row over its own keys: q [A, T, heads, Dh], keys/values [A, span, kv_heads, Dh],
        hidden_mask [A, T, span]; in float32 below it, as ``_attend_one``."""
        live, fed = q.shape[:2]
        span = keys.shape[1]
        group = self.heads // self.kv_heads
        dtype = q.dtype
        if dtype != torch.float32:
            q, keys, values = q.float(), keys.float(), values.float()
        q = q.view(live, fed, self.kv_heads, group, self.head_dim)
        scores = torch.einsum("atkgd,askd->atskg", q, keys) * self.scale  # [A, T, span, kv_heads, group]
        weights = scores.masked_fill(hidden_mask.view(live, fed, span, 1, 1), float("-inf")).softmax(2)
        out = torch.einsum("atskg,askd->atkgd", weights, values)  # [A, T, kv_heads, group, Dh]
        return out.reshape(live, fed, self.heads, self.head_dim).to(dtype)

    def _attend_one(self, q, keys, values, hidden_mask) -> torch.Tensor:
        """One query per row over its own keys: q [A, 1, heads, Dh], keys/values [A, span, kv_heads, Dh].

        Elementwise products and sums: with one query and a few keys per row, a batched matmul or the
        fused attention kernel spends its time on per-row set-up (docs/performance.md).
        Below float32 (serving precision) the products and sums run in float32, as attention kernels
        accumulate: with bfloat16 products more of the base's greedy held-out answers differed from
        transformers' cache, and its accuracy was not theirs (docs/performance.md)."""

        live, span = keys.shape[:2]
        group = self.heads // self.kv_heads
        dtype = q.dtype
        if dtype != torch.float32:
            q, keys, values = q.float(), keys.float(), values.float()
        q = q.view(live, 1, self.kv_heads, group, self.head_dim)
        scores = (q * keys.unsqueeze(3)).sum(-1) * self.scale  # [A, span, kv_heads, group]
        weights = scores.masked_fill(hidden_mask.view(live, span, 1, 1), float("-inf")).softmax(1)
        out = (weights.unsqueeze(-1) * values.unsqueeze(3)).sum(1)  # [A, kv_heads, group, Dh]
        return out.view(live, 1, self.heads, self.head_dim).to(dtype)

    def retire(self, keep: list[int]) -> list[int]:
        """Keep rows ``keep``; the last live rows fill the holes the others leave."""
        remaining = len(keep)
        kept = set(keep)
        holes = [row for row in range(remaining) if row not in kept]
        movers = [row for row in keep if row >= remaining]
        order = list(range(remaining))
        if holes:
            to, src = torch.tensor(holes, device=self.device), torch.tensor(movers, device=self.device)
            for buffer in self.keys + self.values:
                buffer.index_copy_(0, to, buffer.index_select(0, src))
            self.lengths[to] = self.lengths[src]
            for hole, mover in zip(holes, movers):
                order[hole] = mover
        self.live = remaining
        return order

    def sort_rows(self) -> list[int] | None:
        """Put the live rows back in order, longest first, where that pays: a finished row's slot takes the
        last live row, a short one, so rows fall out of order as long ones finish. The order (order[i] is the
        old row now at i), or None if nothing moved: the keys the next ``SORT_PAYBACK_STEPS`` steps would
        save must outweigh the keys copied (the positions the rows hold)."""
        live = self.live
        if live <= ATTEND_BLOCK_ROWS:
            return None
        positions = self.lengths[:live]
        order = torch.argsort(positions, descending=True, stable=True)
        saved = run_keys(attention_runs(positions)) - run_keys(attention_runs(positions[order]))
        if saved * SORT_PAYBACK_STEPS <= int(positions.sum()):
            return None
        held = int(positions.max())
        for buffer in self.keys + self.values:
            used = buffer[:live, :held]
            used.copy_(used.index_select(0, order))
        self.lengths[:live] = positions[order]
        return order.tolist()

    def clear(self) -> None:
        self.live = 0

    # -- the layer, as the model's modules compute it ---------------------------------------------

    def _project(self, layer: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q, k, v [B, T, heads, Dh] of ``hidden`` [B, T, hidden], rotated at the positions of cos and sin."""
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        batch, span = x.shape[:2]
        q = attn.q_proj(x).view(batch, span, self.heads, self.head_dim)
        k = attn.k_proj(x).view(batch, span, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(batch, span, self.kv_heads, self.head_dim)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _finish_layer(self, layer: Any, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        batch, span = hidden.shape[:2]
        hidden = hidden + layer.self_attn.o_proj(attended.reshape(batch, span, -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(hidden)).float()


PREFILL_PADDING_BUDGET = 128
"""Padding positions a prefill chunk may carry before its longest inputs go to a chunk of their own
(``length_chunks``). A chunk costs one more forward call, about what a hundred or two prefill positions cost
on the built-in policy."""

ATTEND_BLOCK_ROWS = 32
"""The unit ``attention_runs`` cuts the batch in: a run is a whole number of these blocks (the last may be short)."""
RUN_OVERHEAD_KEYS = 1024
"""A run's fixed cost (its own attention call in each layer), in keys read by one row (a rough figure:
it decides only where a cut pays, never the result)."""


SORT_PAYBACK_STEPS = 8
"""``SlotCache.sort_rows`` moves rows only if the keys saved over this many decode steps outweigh the copy
(rows are sorted when the engine refills, every few dozen steps)."""


def run_keys(runs: list[tuple[int, int, int]]) -> int:
    """Keys read by a decode step's attention cut into ``runs``: rows x keys, summed over the runs."""
    return sum((end - first) * keys for first, end, keys in runs)


def attention_runs(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """How a decode step's attention is cut: runs (first row, end row, keys) of contiguous rows, each
    attending over the keys of its longest row. ``positions`` [A]: each row's new key index, so row i
    reads positions[i] + 1 keys.

    Rows held longest first (the engine admits them so, they keep their order as they grow, and
    ``SlotCache.sort_rows`` restores it at refill after ``retire`` moved short rows up) make the runs
    near-uniform: a few long rows then cost their own run, not a batch padded to their length. The cuts
    fall between blocks of ``ATTEND_BLOCK_ROWS`` rows and minimise the keys read (rows x their run's
    keys) plus ``RUN_OVERHEAD_KEYS`` a run. The result is the same however the batch is cut; only the
    work differs."""
    live = positions.shape[0]
    counts = positions + 1
    if live <= ATTEND_BLOCK_ROWS:
        return [(0, live, int(counts.max()))]
    blocks = -(-live // ATTEND_BLOCK_ROWS)
    padded = torch.zeros(blocks * ATTEND_BLOCK_ROWS, dtype=counts.dtype, device=counts.device)
    padded[:live] = counts
    widest = padded.view(blocks, ATTEND_BLOCK_ROWS).max(1).values.tolist()  # keys of each block's longest row
    ends = [min(live, (j + 1) * ATTEND_BLOCK_ROWS) for j in range(blocks)]
    # best[j]: the least cost of blocks 0..j-1; cut[j]: where its last run starts
    best, cut = [0] + [float("inf")] * blocks, [0] * (blocks + 1)
    for j in range(1, blocks + 1):
        keys = 0
        for i in range(j - 1, -1, -1):  # the last run is blocks i..j-1
            keys = max(keys, widest[i])
            cost = best[i] + (ends[j - 1] - i * ATTEND_BLOCK_ROWS) * keys + RUN_OVERHEAD_KEYS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], blocks
    while j > 0:
        i = cut[j]
        runs.append((i * ATTEND_BLOCK_ROWS, ends[j - 1], max(widest[i:j])))
        j = i
    return runs[::-1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions, as transformers' ``apply_rotary_pos_emb`` computes them."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class PaddedCache:
    """transformers' cache and forward for any causal LM, left-padded (module doc)."""

    def __init__(self, model: Any, pad_token_id: int):
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self._cache_kwarg = cache_argument(model)
        self.clear()

    @property
    def live(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    def sort_rows(self) -> None:
        """Left-padded rows cost the same in any order: nothing moves."""
        return None

    def clear(self) -> None:
        self.cache = self.mask = self.next_pos = None

    def admit(self, inputs: list[tuple[int, ...]], owner: list[int], width: int) -> torch.Tensor:
        span = max(len(x) for x in inputs)
        ids = torch.tensor([[*[self.pad_token_id] * (span - len(x)), *x] for x in inputs], device=self.device)
        mask = torch.tensor([[0] * (span - len(x)) + [1] * len(x) for x in inputs], device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        rows = torch.tensor(owner, dtype=torch.long, device=self.device)
        cache = cache_of(out)
        if len(inputs) < len(owner):
            cache.batch_select_indices(rows)  # [D, H, span, Dh] -> [n, H, span, Dh] per layer
        self._join(cache, mask[rows], positions[rows, -1] + 1)
        return out.logits[rows, -1, :].float()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.unsqueeze(-1)  # [A, 1]
        self.mask = torch.cat([self.mask, torch.ones_like(ids)], dim=-1)
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=self.next_pos.unsqueeze(-1),
            use_cache=True,
            **{self._cache_kwarg: self.cache},
        )
        self.cache = cache_of(out)
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1, :].float()

    def retire(self, keep: list[int]) -> list[int]:
        if not keep:
            self.clear()
            return keep
        rows = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(rows)
        self.mask, self.next_pos = self.mask[rows], self.next_pos[rows]
        self._trim()
        return keep

    def _trim(self) -> None:
        """Drop the leading columns no remaining row uses. Rows are left-padded, so once the longest
        sequence has left, its padding is all that is left of those columns; without this the mask and
        cache keep growing one column per step for as long as the batch keeps running (refilled waves
        never empty it), and every step and every join pays for the whole history."""
        used = self.mask.any(dim=0)  # [L]
        first = int(used.to(torch.int8).argmax())
        if first == 0:
            return
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, first:, :]
            layer.values = layer.values[:, :, first:, :]

    def _join(self, cache: Any, mask: torch.Tensor, next_pos: torch.Tensor) -> None:
        """Join a freshly prefilled wave to the live rows: the shorter side is left-padded with masked zeros."""
        if self.mask is None:
            self.cache, self.mask, self.next_pos = cache, mask, next_pos
            return

        width = max(self.mask.shape[1], mask.shape[1])

        def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
            missing = width - t.shape[dim]
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[dim] = missing
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        layers = [
            (torch.cat([pad(a.keys, 2), pad(b.keys, 2)]), torch.cat([pad(a.values, 2), pad(b.values, 2)]))
            for a, b in zip(self.cache.layers, cache.layers)
        ]
        self.cache = DynamicCache(ddp_cache_data=layers)
        self.mask = torch.cat([pad(self.mask, 1), pad(mask, 1)])
        self.next_pos = torch.cat([self.next_pos, next_pos])
