"""The DSpark draft's reference forward (DESIGN.md section 5), batched over many blocks.

One code path serves every precision: the model holds its weights and runs its activations in
``dtype`` (float32 for the reference, bfloat16 for a variant).  Matmuls accumulate in fp32 (the CPU
bf16 GEMM does, as GPU tensor cores do); RMSNorm, RoPE, the attention scores and softmax are
computed in fp32 (as FlashAttention keeps QK^T in fp32) and rounded back to ``dtype``.

>>> model = DSpark(config, weights)                      # weights: name -> tensor, incl. lm_head
>>> ctx = model.context(aux, lengths)                    # aux [S, T, A]: once per set of streams
>>> blocks = model.draft(ctx, stream, anchor, first_token)   # U [N, B, V], hf [N, B, H]
>>> greedy = rollout(model, blocks)                      # tokens, logits, confidence [N, B]

MLA detail: the context's per-layer cache is the kv_lora latent (after kv_a_layernorm) and the
rotated shared rope key, as an MLA KV cache holds them; ``kv_b_proj`` expands it to per-head keys
and values inside :meth:`DSpark.draft` (expansion, not weight absorption, so the arithmetic is
DESIGN.md's ``kv_b(RMS(latent)) -> k_nope | v`` literally).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from qstream.errors import QStreamError
from qstream.model.config import DSparkConfig

LM_HEAD = "lm_head.weight"  # borrowed from the target; not part of the draft's own tensors
# Budget of one score tensor (float32 elements): draft()'s [rows, n, M*B, keys] and causal
# mode's [S, n, queries, T].  Contexts longer than the budget allows for one row are attended
# in key chunks with an online softmax (draft) or in query chunks (causal mode).
_SCORE_BUDGET = 1 << 25
_MIN_KEY_CHUNK = 256  # keys per chunk never fall below this, whatever the budget says


def tensor_shapes(config: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """The draft checkpoint's tensors and shapes, in checkpoint order (DESIGN.md's table)."""
    c = config
    n, H, r = c.num_attention_heads, c.hidden_size, c.markov_rank
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (c.vocab_size, H),
        "context_proj.weight": (H, c.aux_size),
        "context_norm.weight": (H,),
    }
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,),
            p + "self_attn.q_a_proj.weight": (c.q_lora_rank, H),
            p + "self_attn.q_a_layernorm.weight": (c.q_lora_rank,),
            p + "self_attn.q_b_proj.weight": (n * c.qk_head_dim, c.q_lora_rank),
            p + "self_attn.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, H),
            p + "self_attn.kv_a_layernorm.weight": (c.kv_lora_rank,),
            p + "self_attn.kv_b_proj.weight": (n * (c.qk_nope_head_dim + c.v_head_dim),
                                               c.kv_lora_rank),
            p + "self_attn.o_proj.weight": (H, n * c.v_head_dim),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, H),
            p + "mlp.up_proj.weight": (c.intermediate_size, H),
            p + "mlp.down_proj.weight": (H, c.intermediate_size),
        })
    shapes["final_norm.weight"] = (H,)
    shapes["markov_head.markov_w1.weight"] = (c.vocab_size, r)
    shapes["markov_head.markov_w2.weight"] = (c.vocab_size, r)
    if c.enable_confidence_head:
        shapes["confidence_head.proj.weight"] = (1, H + r)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def check_tensors(config: DSparkConfig, shapes: Mapping[str, tuple[int, ...]], where: str,
                  extra: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """Strict check: exactly the expected names (plus ``extra``), each with its exact shape.
    Raises QStreamError naming the first offender and ``where`` it was found."""
    expected = {**tensor_shapes(config), **(extra or {})}
    for name in expected:
        if name not in shapes:
            raise QStreamError(f"{where}: missing tensor {name!r} (expected shape "
                               f"{list(expected[name])})")
    for name, shape in shapes.items():
        if name not in expected:
            raise QStreamError(f"{where}: unexpected tensor {name!r} {list(shape)} "
                               "(not part of a DSpark draft of this config)")
        if tuple(shape) != expected[name]:
            raise QStreamError(f"{where}: tensor {name!r} has shape {list(shape)}, expected "
                               f"{list(expected[name])}")


# ---------------------------------------------------------------------------------------------
# Building blocks


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / sqrt(mean(x^2) + eps)`` in fp32 (or wider), returned in x's dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def yarn_inv_freq(config: DSparkConfig) -> torch.Tensor:
    """YaRN inverse frequencies of the rope dims (fp32, [rope/2]), as DeepSeek-V3 computes them:
    interpolated (``/factor``) below a linear ramp between ``low`` and ``high``, extrapolated
    above it."""
    yarn, d, base = config.rope_parameters, config.qk_rope_head_dim, config.rope_theta
    orig = yarn.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), d - 1)
    if low == high:
        high += 0.001  # DeepSeek's guard against a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (yarn.factor * pos_freqs)
    return interpolated * ramp + extrapolated * (1 - ramp)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2j], x[2j+1])`` of x [..., T, d] by ``pos * inv_freq[j]``
    (DeepSeek layout, not half-split).  ``positions`` broadcasts against x's [..., T]; the
    cos/sin factor is 1 (DESIGN.md section 5)."""
    angle = positions.to(torch.float32)[..., None] * inv_freq  # [..., T, d/2]
    cos, sin = angle.cos(), angle.sin()
    pairs = x.to(torch.promote_types(x.dtype, torch.float32)).unflatten(-1, (-1, 2))  # [..., T, d/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
           down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))``."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


# ---------------------------------------------------------------------------------------------
# Outputs


@dataclass(frozen=True)
class ContextCache:
    """Per-stream context, computed once and shared by every block drafted on those streams."""

    latent: tuple[torch.Tensor, ...]  # per layer [S, T, kv_lora], after kv_a_layernorm
    rope_key: tuple[torch.Tensor, ...]  # per layer [S, T, rope], rotated at positions 0..T-1
    lengths: torch.Tensor  # [S] valid context positions per stream


@dataclass(frozen=True)
class Blocks:
    """The non-causal pass over N blocks: everything before the Markov head."""

    logits_base: torch.Tensor  # U [N, B, V] float32 (computed in the model's dtype)
    hidden: torch.Tensor  # hf [N, B, H] float32: final-normed block states
    first_token: torch.Tensor  # [N] int64: ids[p], the Markov head's prev_0


@dataclass(frozen=True)
class Rollout:
    """A Markov-head rollout of every block (greedy, sampled, or teacher-forced)."""

    tokens: torch.Tensor  # [N, B] drafted tokens d_k (teacher-forced: the supplied tokens)
    prev: torch.Tensor  # [N, B] token fed to markov_w1 at step k: [ids[p], d_0, ..., d_{B-2}]
    logits: torch.Tensor  # [N, B, V] float32: U_k + markov_w2 . markov_w1[prev_k]
    confidence: torch.Tensor | None  # [N, B] float32 sigmoid scores; None without the head


# ---------------------------------------------------------------------------------------------
# The model


class DSpark:
    """A DSpark draft with its weights in ``dtype``.  ``weights`` maps every name of
    :func:`tensor_shapes` plus ``lm_head.weight`` [V, H] to a tensor (any float dtype; it is
    converted once).  Nothing here is mutated after construction."""

    def __init__(self, config: DSparkConfig, weights: Mapping[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32):
        check_tensors(config, {k: tuple(v.shape) for k, v in weights.items()}, "weights",
                      extra={LM_HEAD: (config.vocab_size, config.hidden_size)})
        self.config, self.dtype = config, dtype
        self.w = {k: v.detach().to(dtype).contiguous() for k, v in weights.items()}
        self.inv_freq = yarn_inv_freq(config)
        self.scale = config.softmax_scale

    def _layer(self, i: int) -> dict[str, torch.Tensor]:
        p = f"layers.{i}."
        return {k[len(p):]: v for k, v in self.w.items() if k.startswith(p)}

    # -- MLA pieces shared by the block pass and causal mode ----------------------------------

    def _query(self, lw: dict, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """h [..., T, H] -> q [..., T, n, nope+rope] with RoPE on the rope part."""
        c, eps = self.config, self.config.rms_norm_eps
        qa = rms_norm(F.linear(h, lw["self_attn.q_a_proj.weight"]),
                      lw["self_attn.q_a_layernorm.weight"], eps)
        q = F.linear(qa, lw["self_attn.q_b_proj.weight"])
        q = q.unflatten(-1, (c.num_attention_heads, c.qk_head_dim))  # [..., T, n, dk]
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_rope = apply_rope(q_rope.transpose(-2, -3), pos[..., None, :], self.inv_freq)
        return torch.cat((q_nope, q_rope.transpose(-2, -3)), dim=-1)

    def _latent(self, lw: dict, h: torch.Tensor, pos: torch.Tensor):
        """h [..., T, H] -> (latent [..., T, kv_lora] normed, rope key [..., T, rope] rotated)."""
        c = self.config
        kv = F.linear(h, lw["self_attn.kv_a_proj_with_mqa.weight"])
        latent, k_rope = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, lw["self_attn.kv_a_layernorm.weight"], c.rms_norm_eps)
        return latent, apply_rope(k_rope, pos, self.inv_freq)

    def _expand(self, lw: dict, latent: torch.Tensor, k_rope: torch.Tensor):
        """latent [..., T, kv_lora], k_rope [..., T, rope] -> k [..., n, T, dk], v [..., n, T, dv]."""
        c = self.config
        kv = F.linear(latent, lw["self_attn.kv_b_proj.weight"])
        kv = kv.unflatten(-1, (c.num_attention_heads, -1)).transpose(-2, -3)  # [..., n, T, nope+v]
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_rope = k_rope.unsqueeze(-3).expand(*k_nope.shape[:-1], c.qk_rope_head_dim)
        return torch.cat((k_nope, k_rope), dim=-1), v

    def _mlp(self, lw: dict, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, lw["post_attention_layernorm.weight"], self.config.rms_norm_eps)
        return swiglu(h, lw["mlp.gate_proj.weight"], lw["mlp.up_proj.weight"],
                      lw["mlp.down_proj.weight"])

    def _attend(self, scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores, dim=-1).to(self.dtype) @ v

    def _scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """fp32 ``q . k * scale`` (q [..., Tq, dk], k [..., Tk, dk]) -> [..., Tq, Tk]."""
        return (q.float() @ k.float().transpose(-1, -2)) * self.scale

    def attention_causal(self, i: int, h: torch.Tensor, pos: torch.Tensor,
                         query_chunk: int | None = None) -> torch.Tensor:
        """Layer i's MLA attention as an ordinary causal decoder: h [S, T, H] (already
        input-normed) at positions pos [T] -> o_proj output [S, T, H].  Queries are taken
        ``query_chunk`` at a time (default: as many as keep the [S, n, chunk, T] scores
        within the budget); a chunk attends only to the keys up to its last query."""
        lw = self._layer(i)
        q = self._query(lw, h, pos).transpose(1, 2)  # [S, n, T, dk]
        k, v = self._expand(lw, *self._latent(lw, h, pos))  # [S, n, T, dk], [S, n, T, dv]
        S, n, T, _ = q.shape
        chunk = query_chunk or max(1, _SCORE_BUDGET // max(1, S * n * T))
        outs = []
        for q0 in range(0, T, chunk):
            q1 = min(T, q0 + chunk)
            future = torch.ones(q1 - q0, q1, dtype=torch.bool).triu(q0 + 1)  # key j > query
            scores = self._scores(q[:, :, q0:q1], k[:, :, :q1]).masked_fill(future, float("-inf"))
            outs.append(self._attend(scores, v[:, :, :q1]))  # [S, n, chunk, dv]
        out = torch.cat(outs, dim=2).transpose(1, 2).flatten(2)  # [S, T, n*dv]
        return F.linear(out, lw["self_attn.o_proj.weight"])

    # -- causal mode ---------------------------------------------------------------------------

    def causal_hidden(self, ids: torch.Tensor, query_chunk: int | None = None) -> torch.Tensor:
        """Run the draft's layers as a causal decoder over token streams ids [S, T] (positions
        0..T-1; right padding is harmless since nothing attends forward).  Returns every
        layer's output [S, T, L, H] in fp32; ``.flatten(2)`` is an AUX tensor [S, T, L*H] when
        L * H == A (the "boot" aux regime of DESIGN.md section 6).  ``query_chunk``: see
        :meth:`attention_causal`."""
        eps, pos = self.config.rms_norm_eps, torch.arange(ids.shape[1])
        x = F.embedding(ids, self.w["embed_tokens.weight"])  # [S, T, H]
        outs = []
        for i in range(self.config.num_hidden_layers):
            h = rms_norm(x, self.w[f"layers.{i}.input_layernorm.weight"], eps)
            x = x + self.attention_causal(i, h, pos, query_chunk)
            x = x + self._mlp(self._layer(i), x)
            outs.append(x.float())
        return torch.stack(outs, dim=2)

    # -- the block pass ------------------------------------------------------------------------

    def context(self, aux: torch.Tensor, lengths: torch.Tensor | None = None) -> ContextCache:
        """aux [S, T, A] (target hidden states of layers target_layer_ids, concatenated per
        position) -> every layer's context latent and rope key at positions 0..T-1.
        ``lengths`` [S] marks right padding (default: all T valid)."""
        c = self.config
        if aux.dim() != 3 or aux.shape[-1] != c.aux_size:
            raise ValueError(f"aux must be [S, T, {c.aux_size}], got {list(aux.shape)}")
        S, T, _ = aux.shape
        lengths = torch.full((S,), T) if lengths is None else torch.as_tensor(lengths)
        ctx = rms_norm(F.linear(aux.to(self.dtype), self.w["context_proj.weight"]),
                       self.w["context_norm.weight"], c.rms_norm_eps)  # [S, T, H]
        pos = torch.arange(T)
        # each layer's own kv_a_proj_with_mqa on ctx, with no input_layernorm (DESIGN.md)
        pairs = [self._latent(self._layer(i), ctx, pos) for i in range(c.num_hidden_layers)]
        return ContextCache(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs),
                            lengths.to(torch.int64))

    def draft(self, ctx: ContextCache, stream: torch.Tensor, anchor: torch.Tensor,
              first_token: torch.Tensor, key_chunk: int | None = None) -> Blocks:
        """Draft N blocks at once.  Block n sits on stream ``stream[n]`` at anchor position
        ``anchor[n]`` = p (context j < p is visible) and starts from token ``first_token[n]`` =
        ids[p].  Blocks are packed into rows of one stream each, so that all blocks of a stream
        share its context keys; no Python loop runs over blocks.  A context longer than
        ``key_chunk`` keys (default: what one row's scores may span within the budget) is
        attended chunk by chunk with an online softmax, so no temporary spans the context."""
        stream, anchor = torch.as_tensor(stream).long(), torch.as_tensor(anchor).long()
        first_token = torch.as_tensor(first_token).long()
        if not (stream.shape == anchor.shape == first_token.shape) or stream.dim() != 1:
            raise ValueError("stream, anchor and first_token must be 1-D of equal length")
        if stream.numel() and bool((anchor > ctx.lengths[stream]).any() or (anchor < 0).any()):
            raise ValueError("every anchor p must satisfy 0 <= p <= its stream's context length")
        if first_token.numel() and not (0 <= int(first_token.min()) and
                                        int(first_token.max()) < self.config.vocab_size):
            raise ValueError(f"first_token ids must lie in [0, {self.config.vocab_size})")
        packing = _pack(stream, anchor)
        T_max = int(anchor.max()) if anchor.numel() else 0
        B, n = self.config.block_size, self.config.num_attention_heads
        key_chunk = key_chunk or max(_MIN_KEY_CHUNK, _SCORE_BUDGET // (n * packing.M * B))
        keys = min(max(T_max, 1), key_chunk)
        rows_per_chunk = max(1, _SCORE_BUDGET // max(1, n * packing.M * B * keys))
        U, hf = [], []
        for r0 in range(0, packing.R, rows_per_chunk):
            u, h = self._draft_rows(ctx, packing, slice(r0, r0 + rows_per_chunk), first_token,
                                    key_chunk)
            U.append(u)
            hf.append(h)
        U_rows, hf_rows = torch.cat(U), torch.cat(hf)  # [R*M, B, V], [R*M, B, H]
        if not packing.in_order:  # [N, B, V] gathers are costly at V = 32k: skip when possible
            U_rows, hf_rows = U_rows[packing.slot_of_block], hf_rows[packing.slot_of_block]
        return Blocks(U_rows.float(), hf_rows.float(), first_token)

    def _draft_rows(self, ctx: ContextCache, pk: "_Packing", rows: slice,
                    first_token: torch.Tensor, key_chunk: int):
        c, B = self.config, self.config.block_size
        row_stream, row_anchor = pk.row_stream[rows], pk.anchor[rows]  # [R], [R, M]
        R, M = row_anchor.shape
        T = max(int(row_anchor.max()), 1)
        tokens = torch.full((R, M, B), c.mask_token_id)
        tokens[..., 0] = pk.first_token_slots(first_token)[rows]
        pos = row_anchor[..., None] + torch.arange(B)  # [R, M, B]
        # context j < p only: position p itself and everything after it is hidden
        hidden = torch.arange(T) >= row_anchor[..., None, None]  # [R, M, 1, T]
        x = F.embedding(tokens, self.w["embed_tokens.weight"])  # [R, M, B, H]
        for i in range(c.num_hidden_layers):
            lw = self._layer(i)
            h = rms_norm(x, lw["input_layernorm.weight"], c.rms_norm_eps)
            q = self._query(lw, h, pos).permute(0, 3, 1, 2, 4)  # [R, n, M, B, dk]
            k_blk, v_blk = self._expand(lw, *self._latent(lw, h, pos))  # [R, M, n, B, d]
            s_blk = self._scores(q, k_blk.transpose(1, 2))  # [R, n, M, B, B]: no causal mask
            latent, rope_key = (_rows(c[i], row_stream, T) for c in (ctx.latent, ctx.rope_key))
            if T <= key_chunk:
                out = self._attend_block(lw, q, s_blk, v_blk, latent, rope_key, hidden)
            else:
                out = self._attend_block_chunked(lw, q, s_blk, v_blk, latent, rope_key, hidden,
                                                 key_chunk)
            out = out.permute(0, 2, 3, 1, 4).flatten(3)  # [R, M, B, n*dv]
            x = x + F.linear(out, lw["self_attn.o_proj.weight"])
            x = x + self._mlp(lw, x)
        hf = rms_norm(x, self.w["final_norm.weight"], c.rms_norm_eps).flatten(0, 1)  # [R*M, B, H]
        return F.linear(hf, self.w[LM_HEAD]), hf


    def _attend_block(self, lw, q, s_blk, v_blk, latent, rope_key, hidden) -> torch.Tensor:
        """One softmax over the whole context plus the block: -> [R, n, M, B, dv]."""
        R, n, M, B, _ = q.shape
        T = latent.shape[1]
        k_ctx, v_ctx = self._expand(lw, latent, rope_key)  # [R, n, T, d]
        s_ctx = self._scores(q.flatten(2, 3), k_ctx).unflatten(2, (M, B))  # [R, n, M, B, T]
        s_ctx = s_ctx.masked_fill(hidden[:, None], float("-inf"))
        p = torch.softmax(torch.cat((s_ctx, s_blk), dim=-1), dim=-1).to(self.dtype)
        p_ctx, p_blk = p.split([T, B], dim=-1)
        out = (p_ctx.flatten(2, 3) @ v_ctx).unflatten(2, (M, B))  # [R, n, M, B, dv]
        return out + p_blk @ v_blk.transpose(1, 2)

    def _attend_block_chunked(self, lw, q, s_blk, v_blk, latent, rope_key, hidden,
                              key_chunk: int) -> torch.Tensor:
        """The same attention with the context keys taken ``key_chunk`` at a time: an online
        softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022) keeping the running
        max ``m``, sum ``l`` and output in fp32; each chunk's probabilities are rounded to the
        model's dtype for the P·V product, as FlashAttention does.  The block's own keys come
        first, so ``m`` is finite from the start (they are never masked)."""
        R, n, M, B, _ = q.shape
        m = s_blk.amax(-1, keepdim=True)  # [R, n, M, B, 1]
        e = torch.exp(s_blk - m)
        l = e.sum(-1, keepdim=True)
        acc = (e.to(self.dtype) @ v_blk.transpose(1, 2)).float()  # [R, n, M, B, dv]
        q_flat = q.flatten(2, 3)  # [R, n, M*B, dk]
        for t0 in range(0, latent.shape[1], key_chunk):
            t1 = min(latent.shape[1], t0 + key_chunk)
            k_ctx, v_ctx = self._expand(lw, latent[:, t0:t1], rope_key[:, t0:t1])  # [R, n, c, d]
            s = self._scores(q_flat, k_ctx).unflatten(2, (M, B))  # [R, n, M, B, c]
            s = s.masked_fill(hidden[:, None, ..., t0:t1], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            rescale = torch.exp(m - m_new)
            e = torch.exp(s - m_new)
            l = l * rescale + e.sum(-1, keepdim=True)
            pv = (e.to(self.dtype).flatten(2, 3) @ v_ctx).unflatten(2, (M, B))
            acc = acc * rescale + pv.float()
            m = m_new
        return (acc / l).to(self.dtype)


def _rows(cache: torch.Tensor, row_stream: torch.Tensor, T: int) -> torch.Tensor:
    """cache [S, T_all, d] -> [R, T, d] for the rows' streams (a view when rows are streams)."""
    if row_stream.numel() == cache.shape[0] and bool(
            (row_stream == torch.arange(cache.shape[0])).all()):
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
            (self.slot_of_block == torch.arange(self.slot_of_block.numel())).all())

    def first_token_slots(self, first_token: torch.Tensor) -> torch.Tensor:
        """[N] per block -> [R, M] per slot (padding slots get the first block's token)."""
        idx = self.block_of_slot.clamp(min=0)
        return first_token[idx].view(-1, self.M)


def _pack(stream: torch.Tensor, anchor: torch.Tensor) -> _Packing:
    """Group blocks by stream into rows of M slots.  M is the largest per-stream count when
    that wastes little padding, else the mean count (a busy stream then spans several rows)."""
    N = stream.numel()
    order = torch.sort(stream, stable=True).indices
    streams, counts = torch.unique_consecutive(stream[order], return_counts=True)
    M = int(counts.max()) if N else 1
    if M * streams.numel() > 1.5 * N:
        M = max(1, math.ceil(N / streams.numel()))
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
    return _Packing(torch.repeat_interleave(streams, rows_per_stream), anchors.view(R, M),
                    block_of_slot, slot_of_block, M)


# ---------------------------------------------------------------------------------------------
# Markov head, rollouts and confidence


def markov_logits(model: DSpark, logits_base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """Teacher-forced per-position logits ``U_k + markov_w2 . markov_w1[prev_k]`` (fp32).
    logits_base [..., V], prev [...] (the token fed at each position)."""
    emb = F.embedding(prev, model.w["markov_head.markov_w1.weight"])  # [..., r]
    bias = F.linear(emb, model.w["markov_head.markov_w2.weight"])  # [..., V]
    return logits_base.float() + bias.float()


def confidence(model: DSpark, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
    """``sigmoid(proj([hf_k ; markov_w1[prev_k]]))`` per position (fp32); None when the
    config has no confidence head."""
    if not model.config.enable_confidence_head:
        return None
    emb = F.embedding(prev, model.w["markov_head.markov_w1.weight"])  # [..., r]
    feats = torch.cat((hidden.to(model.dtype), emb), dim=-1)  # [..., H + r]
    z = F.linear(feats, model.w["confidence_head.proj.weight"],
                 model.w["confidence_head.proj.bias"])
    return torch.sigmoid(z.float()).squeeze(-1)


def sampling_probs(logits: torch.Tensor, temperature: float = 1.0,
                   top_p: float = 0.95) -> torch.Tensor:
    """The distribution probabilistic drafting samples from: softmax(logits / temperature)
    restricted to the top-p nucleus (smallest prefix of the sorted probabilities whose mass
    reaches top_p; the top token is always kept) and renormalised.  fp32 [..., V]."""
    if temperature <= 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature must be > 0 and top_p in (0, 1], got {temperature}, "
                         f"{top_p}")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """Exponential-race draw: ``argmax(probs / race)`` with ``race`` iid Exp(1) per token, which
    draws exactly from ``probs`` (the Gumbel-max trick; vLLM's sampler draws this way).  Two
    models given the same ``race`` draw the same token unless their distributions differ, and
    then with probability at most 2·TV/(1+TV): a near-maximal coupling that does not depend on
    the order of the vocabulary.  Tokens of zero probability are never drawn."""
    return (probs / race).argmax(-1)


def rollout(model: DSpark, blocks: Blocks, noise: torch.Tensor | None = None,
            temperature: float = 1.0, top_p: float = 0.95) -> Rollout:
    """Free-running Markov rollout: prev_0 = ids[p]; at step k draw d_k from
    ``U_k + markov_w2 . markov_w1[prev_k]`` and feed it as prev_{k+1}.  ``noise=None`` is
    greedy (argmax); otherwise noise [N, B, V] holds iid Exp(1) variates and d_k is drawn by
    :func:`sample` from :func:`sampling_probs` (temperature, top-p)."""
    N, B, V = blocks.logits_base.shape
    if noise is not None and tuple(noise.shape) != (N, B, V):
        raise ValueError(f"noise must be [{N}, {B}, {V}], got {list(noise.shape)}")
    prev = torch.empty(N, B, dtype=torch.int64)
    tokens = torch.empty(N, B, dtype=torch.int64)
    logits = torch.empty(blocks.logits_base.shape, dtype=torch.float32)
    token = blocks.first_token
    for k in range(B):  # sequential by definition: step k needs d_{k-1}
        prev[:, k] = token
        logits[:, k] = markov_logits(model, blocks.logits_base[:, k], token)
        if noise is None:
            token = logits[:, k].argmax(-1)
        else:
            token = sample(sampling_probs(logits[:, k], temperature, top_p), noise[:, k])
        tokens[:, k] = token
    return Rollout(tokens, prev, logits, confidence(model, blocks.hidden, prev))


def teacher_forced(model: DSpark, blocks: Blocks, tokens: torch.Tensor) -> Rollout:
    """Per-position logits and confidence when the drafted tokens are given (e.g. the
    reference's rollout): prev = [ids[p], tokens[:, 0], ..., tokens[:, B-2]]."""
    prev = torch.cat((blocks.first_token[:, None], tokens[:, :-1]), dim=1)  # [N, B]
    return Rollout(tokens, prev, markov_logits(model, blocks.logits_base, prev),
                   confidence(model, blocks.hidden, prev))
