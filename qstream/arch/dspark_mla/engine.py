"""How :meth:`DSpark.draft` computes :meth:`DSpark.draft_one` for N blocks in one pass within a
memory budget: blocks packed R rows x M slots, a row holding blocks of one stream so that its
context keys are expanded once (a per-slot mask hides keys at or after each anchor); rows taken
a few at a time so one score tensor stays within ``SCORE_BUDGET``; a long context attended in key
chunks with an online softmax; causal mode in query chunks, or streamed over its MLA cache
(:mod:`.causal`).  tests/test_model_forward.py checks ``draft`` against ``draft_one``, and
tests/test_sensitivity_context.py the chunked paths against the one-pass ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from qstream.arch.dspark_mla.config import DSparkConfig
from qstream.arch.dspark_mla.flops import expand_flops, position_flops

# Budget of one score tensor (float32 elements): draft's [rows, n, M*B, keys] and causal mode's
# [S, n, queries, T].
SCORE_BUDGET = 1 << 25
MIN_KEY_CHUNK = 256  # keys per chunk never fall below this, whatever the budget says


class Layer(Protocol):
    """What the engine calls of one decoder layer (qstream/arch/dspark_mla/forward.py's)."""

    def input_norm(self, x: torch.Tensor) -> torch.Tensor: ...
    def query(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor: ...
    def latent(self, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def expand(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, ...]: ...
    def attention_output(self, out: torch.Tensor) -> torch.Tensor: ...
    def mlp(self, x: torch.Tensor) -> torch.Tensor: ...


class DSpark(Protocol):
    """What the engine calls of the model (forward.py's :class:`DSpark`)."""

    @property
    def config(self) -> DSparkConfig: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def layers(self) -> Sequence[Layer]: ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor: ...
    def head(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor: ...
    def attend(self, scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class ContextCache(Protocol):
    """Per layer, the context's MLA cache (forward.py's :class:`ContextCache`)."""

    @property
    def latent(self) -> tuple[torch.Tensor, ...]: ...
    @property
    def rope_key(self) -> tuple[torch.Tensor, ...]: ...


def draft_packed(
    model: DSpark,
    ctx: ContextCache,
    stream: torch.Tensor,
    anchor: torch.Tensor,
    first_token: torch.Tensor,
    key_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`DSpark.draft_one` for N blocks (stream, anchor, first_token [N], already checked):
    returns U [N, B, V] and hf [N, B, H] in the model's dtype."""
    T_max = int(anchor.max()) if anchor.numel() else 0
    packing = _pack(stream, anchor, _row_cost(model.config, T_max))
    B, n = model.config.block_size, model.config.num_attention_heads
    key_chunk = key_chunk or max(MIN_KEY_CHUNK, SCORE_BUDGET // (n * packing.M * B))
    keys = min(max(T_max, 1), key_chunk)
    rows_per_chunk = max(1, SCORE_BUDGET // max(1, n * packing.M * B * keys))
    chunks = [
        _draft_rows(model, ctx, packing, slice(r0, r0 + rows_per_chunk), first_token, key_chunk)
        for r0 in range(0, packing.R, rows_per_chunk)
    ]
    U_rows, hf_rows = (torch.cat(parts) for parts in zip(*chunks))  # [R*M, B, V], [R*M, B, H]
    if not packing.in_order:  # [N, B, V] gathers are costly at V = 32k: skip when possible
        slots = packing.slot_of_block.to(U_rows.device)
        U_rows, hf_rows = U_rows[slots], hf_rows[slots]
    return U_rows, hf_rows


def _draft_rows(
    model: DSpark,
    ctx: ContextCache,
    pk: _Packing,
    rows: slice,
    first_token: torch.Tensor,
    key_chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers of draft_one over a chunk of packed rows -> U [R*M, B, V], hf [R*M, B, H]."""
    c, B, dev = model.config, model.config.block_size, model.device
    row_stream, row_anchor = pk.row_stream[rows], pk.anchor[rows]  # [R], [R, M]
    R, M = row_anchor.shape
    T = max(int(row_anchor.max()), 1)
    row_stream, row_anchor = row_stream.to(dev), row_anchor.to(dev)
    tokens = torch.full((R, M, B), c.mask_token_id, device=dev)
    tokens[..., 0] = pk.first_token_slots(first_token.cpu())[rows].to(dev)
    pos = row_anchor[..., None] + torch.arange(B, device=dev)  # [R, M, B]
    # context j < p only: position p itself and everything after it is hidden
    hidden = torch.arange(T, device=dev) >= row_anchor[..., None, None]  # [R, M, 1, T]
    x = model.embed(tokens)  # [R, M, B, H]
    for layer, latent, rope_key in zip(model.layers, ctx.latent, ctx.rope_key):
        h = layer.input_norm(x)
        q = layer.query(h, pos).permute(0, 3, 1, 2, 4)  # [R, n, M, B, dk]
        k_blk, v_blk = layer.expand(*layer.latent(h, pos))  # [R, M, n, B, d]
        s_blk = model.scores(q, k_blk.transpose(1, 2))  # [R, n, M, B, B]: no causal mask
        latent, rope_key = _rows(latent, row_stream, T), _rows(rope_key, row_stream, T)
        if T <= key_chunk:
            out = _attend_block(model, layer, q, s_blk, v_blk, latent, rope_key, hidden)
        else:
            out = _attend_block_chunked(
                model, layer, q, s_blk, v_blk, latent, rope_key, hidden, key_chunk
            )
        out = out.permute(0, 2, 3, 1, 4).flatten(3)  # [R, M, B, n*dv]
        x = x + layer.attention_output(out)
        x = x + layer.mlp(x)
    return model.head(x.flatten(0, 1))  # [R*M, B, V], [R*M, B, H]


def _attend_block(
    model: DSpark, layer: Layer, q, s_blk, v_blk, latent, rope_key, hidden
) -> torch.Tensor:
    """One softmax over the whole context plus the block: -> [R, n, M, B, dv]."""
    M, B = q.shape[2:4]  # q [R, n, M, B, dk]
    T = latent.shape[1]
    k_ctx, v_ctx = layer.expand(latent, rope_key)  # [R, n, T, d]
    s_ctx = model.scores(q.flatten(2, 3), k_ctx).unflatten(2, (M, B))  # [R, n, M, B, T]
    s_ctx = s_ctx.masked_fill(hidden[:, None], float("-inf"))
    p = torch.softmax(torch.cat((s_ctx, s_blk), dim=-1), dim=-1).to(model.dtype)
    p_ctx, p_blk = p.split([T, B], dim=-1)
    out = (p_ctx.flatten(2, 3) @ v_ctx).unflatten(2, (M, B))  # [R, n, M, B, dv]
    return out + p_blk @ v_blk.transpose(1, 2)


def _attend_block_chunked(
    model: DSpark, layer: Layer, q, s_blk, v_blk, latent, rope_key, hidden, key_chunk: int
) -> torch.Tensor:
    """The same attention with the context keys taken ``key_chunk`` at a time (an
    :class:`OnlineSoftmax`).  The block's own keys come first, so the running max is finite
    from the start (they are never masked)."""
    M, B = q.shape[2:4]  # q [R, n, M, B, dk]
    softmax = OnlineSoftmax(model.dtype)
    softmax.add(s_blk, lambda p: p @ v_blk.transpose(1, 2))  # [R, n, M, B, dv]
    q_flat = q.flatten(2, 3)  # [R, n, M*B, dk]
    for t0 in range(0, latent.shape[1], key_chunk):
        t1 = min(latent.shape[1], t0 + key_chunk)
        k_ctx, v_ctx = layer.expand(latent[:, t0:t1], rope_key[:, t0:t1])  # [R, n, c, d]
        s = model.scores(q_flat, k_ctx).unflatten(2, (M, B))  # [R, n, M, B, c]
        s = s.masked_fill_(hidden[:, None, ..., t0:t1], float("-inf"))
        softmax.add(s, lambda p: (p.flatten(2, 3) @ v_ctx).unflatten(2, (M, B)))
    return softmax.result()


class OnlineSoftmax:
    """softmax(scores) · V over keys taken a chunk at a time (Milakov & Gimelshein 2018;
    FlashAttention, Dao et al. 2022): the running max, sum and output are kept in fp32, and
    each chunk's probabilities are rounded to ``dtype`` for the P·V product, as FlashAttention
    does.  The first chunk must leave every query at least one visible key."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.m: torch.Tensor | None = None

    def add(self, s: torch.Tensor, pv: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Scores ``s`` [..., keys] of one chunk, overwritten (exponentiated in place: one
        score-sized temporary less); ``pv(p)`` multiplies the chunk's rounded probabilities
        by its values."""
        if self.m is None:
            self.m = s.amax(-1, keepdim=True)
            e = s.sub_(self.m).exp_()
            self.denom = e.sum(-1, keepdim=True)
            self.acc = pv(e.to(self.dtype)).float()
            return
        m_new = torch.maximum(self.m, s.amax(-1, keepdim=True))
        rescale = (self.m - m_new).exp_()
        e = s.sub_(m_new).exp_()
        self.denom = self.denom.mul_(rescale).add_(e.sum(-1, keepdim=True))
        self.acc = self.acc.mul_(rescale).add_(pv(e.to(self.dtype)).float())
        self.m = m_new

    def result(self) -> torch.Tensor:
        return (self.acc / self.denom).to(self.dtype)


def causal_attention(
    model: DSpark, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_chunk: int | None = None
) -> torch.Tensor:
    """Causal softmax attention of q, k [S, n, T, dk] and v [S, n, T, dv] -> [S, n, T, dv].
    Queries are taken ``query_chunk`` at a time (default: as many as keep the [S, n, chunk, T]
    scores within the budget); a chunk attends only to the keys up to its last query."""
    S, n, T, _ = q.shape
    chunk = query_chunk or max(1, SCORE_BUDGET // max(1, S * n * T))
    outs = []
    for q0 in range(0, T, chunk):
        q1 = min(T, q0 + chunk)
        future = torch.ones(q1 - q0, q1, dtype=torch.bool, device=q.device).triu(q0 + 1)  # j > q
        scores = model.scores(q[:, :, q0:q1], k[:, :, :q1]).masked_fill(future, float("-inf"))
        outs.append(model.attend(scores, v[:, :, :q1]))  # [S, n, chunk, dv]
    return torch.cat(outs, dim=2)


def cached_causal_attention(
    model: DSpark,
    layer: Layer,
    q: torch.Tensor,
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    key_chunk: int | None = None,
) -> torch.Tensor:
    """Causal attention of the queries q [S, n, t, dk] at the last t positions of an MLA cache
    latent [S, T, kv_lora], rope_key [S, T, rope] (keys 0..T-1) -> [S, n, t, dv].  A cache
    longer than ``key_chunk`` keys (default: as many as keep [S, n, t, keys] within the
    budget) is expanded a chunk at a time into an :class:`OnlineSoftmax`, so no temporary spans
    it; a shorter one takes one pass, the arithmetic of :func:`causal_attention`."""
    S, n, t, _ = q.shape
    T = latent.shape[1]
    key_chunk = key_chunk or max(MIN_KEY_CHUNK, SCORE_BUDGET // max(1, S * n * t))
    query_pos = torch.arange(T - t, T, device=q.device)[:, None]  # [t, 1]

    def scores(k0: int, k: torch.Tensor) -> torch.Tensor:  # [S, n, t, keys k0..]: j > query hidden
        s = model.scores(q, k)
        if k0 + k.shape[-2] - 1 <= T - t:  # every key at or before every query
            return s
        future = torch.arange(k0, k0 + k.shape[-2], device=q.device) > query_pos
        return s.masked_fill_(future, float("-inf"))

    if T <= key_chunk:
        k, v = layer.expand(latent, rope_key)  # [S, n, T, d]
        return model.attend(scores(0, k), v)
    softmax = OnlineSoftmax(model.dtype)
    for k0 in range(0, T, key_chunk):  # key 0 is visible to every query: the first m is finite
        k, v = layer.expand(latent[:, k0 : k0 + key_chunk], rope_key[:, k0 : k0 + key_chunk])
        softmax.add(scores(k0, k), lambda p: p @ v)
    return softmax.result()


# ---------------------------------------------------------------------------------------------
# Packing blocks into rows of one stream


def _rows(cache: torch.Tensor, row_stream: torch.Tensor, T: int) -> torch.Tensor:
    """cache [S, T_all, d] -> [R, T, d] for the rows' streams (a view when rows are streams)."""
    if row_stream.numel() == cache.shape[0] and bool(
        (row_stream == torch.arange(cache.shape[0], device=row_stream.device)).all()
    ):
        return cache[:, :T]
    return cache[row_stream, :T]


@dataclass(frozen=True)
class _Packing:
    """Blocks laid out as R rows x M slots, each row holding blocks of a single stream."""

    row_stream: torch.Tensor  # [R]
    anchor: torch.Tensor  # [R, M] (padding slots: 0)
    block_of_slot: torch.Tensor  # [R*M] index of the block in each slot (padding: -1)
    slot_of_block: torch.Tensor  # [N] flat slot of each block
    M: int

    @property
    def R(self) -> int:
        return self.row_stream.numel()

    @property
    def in_order(self) -> bool:
        """Slot i holds block i (no padding, blocks given stream by stream)."""
        return self.slot_of_block.numel() == self.block_of_slot.numel() and bool(
            (self.slot_of_block == torch.arange(self.slot_of_block.numel())).all()
        )

    def first_token_slots(self, first_token: torch.Tensor) -> torch.Tensor:
        """[N] per block -> [R, M] per slot (padding slots get the first block's token)."""
        idx = self.block_of_slot.clamp(min=0)
        return first_token[idx].view(-1, self.M)


def _row_cost(c: DSparkConfig, T: int) -> float:
    """A packed row's own work (expanding ``T`` context keys in every layer) in units of one
    slot's work (B positions attending to T + B keys), by the FLOP model."""
    return T * expand_flops(c) / (c.block_size * position_flops(c, T + c.block_size))


def _pack(stream: torch.Tensor, anchor: torch.Tensor, row_cost: float = 0.0) -> _Packing:
    """Group blocks by stream into rows of M slots.  M minimises the work: a padding slot costs
    a block's whole forward, a row ``row_cost`` slots (its context keys expanded once for its
    blocks).  At K3 a stream of 2 blocks beside streams of 1 is cheaper in two rows of one
    slot than in one row of two beside half-empty rows (docs/eval-drift.md, "Batching")."""
    N = stream.numel()
    order = torch.sort(stream, stable=True).indices
    streams, counts = torch.unique_consecutive(stream[order], return_counts=True)
    M = 1
    if N:
        work = {
            m: int(((counts + m - 1) // m).sum()) * (m + row_cost)
            for m in range(1, int(counts.max()) + 1)
        }
        M = min(work, key=lambda m: (work[m], -m))
    rows_per_stream = (counts + M - 1) // M
    row_start = torch.cumsum(rows_per_stream, 0) - rows_per_stream
    stream_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(N) - torch.repeat_interleave(stream_start, counts)  # rank within stream
    row = torch.repeat_interleave(row_start, counts) + rank // M
    slot = row * M + rank % M  # flat slot of block order[j]
    R = int(rows_per_stream.sum())
    block_of_slot = torch.full((R * M,), -1, dtype=torch.int64)
    block_of_slot[slot] = order
    slot_of_block = torch.empty(N, dtype=torch.int64)
    slot_of_block[order] = slot
    anchors = torch.zeros(R * M, dtype=torch.int64)
    anchors[slot] = anchor[order]
    return _Packing(
        torch.repeat_interleave(streams, rows_per_stream),
        anchors.view(R, M),
        block_of_slot,
        slot_of_block,
        M,
    )
