"""The Qwen3-style DSpark draft's forward (docs/qwen3-dspark.md, "Forward"), computed as the
DSpark-MLA one is (qstream/arch/dspark_mla/model.py) in every precision.

>>> model = Qwen3DSpark(config, weights)                  # weights: name -> tensor, + lm_head
>>> ctx = model.context(aux, lengths)                     # aux [S, T, A]: once per stream set
>>> blocks = model.draft(ctx, stream, anchor, first_token)  # U [N, B, Vd], hf [N, B, H]

As vLLM 0.32.0 computes it (vllm/model_executor/models/qwen3_dflash.py): the context
``x = RMS(fc(aux), hidden_norm)`` is projected by every layer's own k_proj (then k_norm and
RoPE) and v_proj with no input_layernorm (``DFlashQwen3Model.precompute_and_store_context_kv``);
a block of ``[ids[p], mask, ...]`` at positions p.. attends, with no causal mask, to the
context j < p and to itself (``DFlashQwen3Attention.forward``: q/k RMSNorm per head, neox RoPE,
GQA).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from qstream.arch.dspark_qwen3 import Qwen3DSparkConfig, check_tensors
from qstream.arch.family import check_blocks, context_lengths
from qstream.arch.interface import EMBED, LM_HEAD, AuxChunks, Blocks
from qstream.arch.weights import (
    CausalRows,
    ComputeWeights,
    ServedLinears,
    embedding,
    fp8_round_trip,
    inv_freq,
    rms_norm,
    swiglu,
)
from qstream.serving import KV_CACHES, KVCache

CONTEXT_ELEMENTS = 1 << 26  # aux elements projected at a time by context()
SCORE_BUDGET = 1 << 25  # attention score elements computed at a time


def apply_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, mscale: float):
    """Neox RoPE: rotate the halves of x [..., T, heads, d] by ``pos * inv_freq``, cos and sin
    scaled by YaRN's ``mscale``."""
    angle = pos.to(torch.float32)[..., None] * inv_freq  # [..., T, d/2]
    cos, sin = (angle.cos() * mscale)[..., None, :], (angle.sin() * mscale)[..., None, :]
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@dataclass(frozen=True)
class ContextKV:
    """Per layer, the context's keys (normed, rotated) and values at positions 0..T-1."""

    k: tuple[torch.Tensor, ...]  # [S, T, kv, d]
    v: tuple[torch.Tensor, ...]  # [S, T, kv, d]
    lengths: torch.Tensor  # [S] valid context positions per stream


class Qwen3DSpark:
    """A Qwen3-style DSpark draft computing in ``dtype``: ``weights`` maps the tensor table's
    names with ``embed_tokens.weight`` and ``lm_head.weight`` to tensors of any float dtype."""

    def __init__(
        self,
        config: Qwen3DSparkConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv: KVCache = KV_CACHES["auto"],
        served: ServedLinears | None = None,
    ):
        shapes = {k: tuple(v.shape) for k, v in weights.items()}
        check_tensors(config, shapes, "weights")
        for name in (EMBED, LM_HEAD):
            if name not in shapes:
                raise ValueError(
                    f"weights: {name} is required (the target's, when not the draft's)"
                )
        self.config, self.dtype = config, dtype
        index = ("d2t", "t2d")  # index maps, not weights: never held in a float dtype
        # On the CPU a bf16 model multiplies its operands upcast exactly to fp32 (see matmul)
        upcast = dtype != torch.float32 and torch.device(device).type == "cpu"
        served = replace(served or ServedLinears(), fp32_products=upcast)
        computed = {k: v for k, v in weights.items() if k not in index}
        self.w = ComputeWeights(computed, dtype, device, served)
        self.device = self.w.device
        d2t = weights.get("d2t")
        # draft id -> target id (qstream.arch.markov.draft_to_target)
        self.d2t = (
            None
            if d2t is None
            else torch.arange(len(d2t)).to(self.device) + d2t.long().to(self.device)
        )
        rope = config.rope_parameters
        yarn = rope if rope.rope_type == "yarn" else None
        self.inv_freq = inv_freq(config.head_dim, float(rope.rope_theta), yarn).to(self.device)
        self.mscale = config.rope_parameters.mscale
        self.scale = config.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.kv_fp8 = getattr(torch, str(kv.dtype)) if kv.quantized else None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return embedding(self.w, EMBED, tokens)

    def proj(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T (+ b)``, the bias added in fp32 before rounding (as a GEMM epilogue adds it)."""
        bias = self.w.stored.get(f"{name}.bias")
        if bias is None:
            return self.matmul(f"{name}.weight", x)
        return (self.matmul(f"{name}.weight", x, torch.float32) + bias.float()).to(self.dtype)

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w[f"{name}.weight"], self.eps)

    def key_value(self, i: int, h: torch.Tensor, pos: torch.Tensor):
        """Layer i's keys (k_norm, RoPE) and values of h [..., T, H]: [..., T, kv, d] each, as
        every read of the KV cache sees them: an fp8 cache's are rounded (the context's by
        ``precompute_and_store_context_kv``, the block's own by the attention layer's cache
        update before it attends, ``unified_kv_cache_update``; docs/eval-drift.md, "KV cache"),
        each divided by its layer's scale (``do_kv_cache_update`` with ``_k_scale``, ``_v_scale``)."""
        c, a = self.config, f"layers.{i}.self_attn."
        k = self.proj(a + "k_proj", h).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        v = self.proj(a + "v_proj", h).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        k = apply_rope(self.norm(k, a + "k_norm"), pos, self.inv_freq, self.mscale)
        served, attention = self.w.served, a.removesuffix(".")
        if served.observe_cache is not None:
            served.observe_cache(attention, k, v)
        if self.kv_fp8 is None:
            return k, v
        k_scale, v_scale = served.cache_scales(attention)
        return fp8_round_trip(k, self.kv_fp8, k_scale), fp8_round_trip(v, self.kv_fp8, v_scale)

    def query(self, i: int, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Layer i's queries (q_norm, RoPE) [..., T, kv, group, d]."""
        c, a = self.config, f"layers.{i}.self_attn."
        q = self.proj(a + "q_proj", h).unflatten(-1, (c.num_attention_heads, c.head_dim))
        q = apply_rope(self.norm(q, a + "q_norm"), pos, self.inv_freq, self.mscale)
        return q.unflatten(-2, (c.num_key_value_heads, -1))

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x, f"layers.{i}.post_attention_layernorm")
        p = f"layers.{i}.mlp."
        return swiglu(h, p + "gate_proj", p + "up_proj", p + "down_proj", self._linear)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.matmul(f"{name}.weight", x)

    def matmul(self, name: str, x: torch.Tensor, out: torch.dtype | None = None) -> torch.Tensor:
        """``x @ W^T`` accumulated in fp32, rounded to ``out`` (the model's dtype).  On the CPU a bf16
        model multiplies its operands upcast exactly to fp32 (``ServedLinears.fp32_products``):
        torch's CPU bf16 kernel is ~10x slower and differs only in the order of the fp32 sums."""
        return self.w.linear(name, x, out)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None):
        """q [..., Tq, kv, g, d] over k, v [..., Tk, kv, d] (``mask`` [..., Tq, Tk] True where
        visible) -> [..., Tq, n*d]."""
        s = torch.einsum("...qkgd,...tkd->...kgqt", q.float(), k.float()) * self.scale
        if mask is not None:
            s = s.masked_fill(~mask[..., None, None, :, :], float("-inf"))
        p = torch.softmax(s, dim=-1).to(self.dtype)
        out = torch.einsum("...kgqt,...tkd->...qkgd", p.float(), v.float())  # upcasts: exact
        return out.to(self.dtype).flatten(-3)

    def context(self, aux: torch.Tensor | AuxChunks, lengths: torch.Tensor | None = None):
        """aux [S, T, A] -> every layer's context keys and values at positions 0..T-1 (``lengths``
        [S]: right padding), projected ``CONTEXT_ELEMENTS`` at a time."""
        c = self.config
        S, T, lengths = context_lengths(c.aux_size, aux, lengths)
        step = max(1, CONTEXT_ELEMENTS // max(1, S * c.aux_size))
        pieces = []
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            rows = aux[:, t0:t1] if isinstance(aux, torch.Tensor) else aux.rows(t0, t1)
            x = self.norm(self.proj("fc", rows.to(self.device, self.dtype)), "hidden_norm")
            pos = torch.arange(t0, t1, device=self.device)
            pieces.append([self.key_value(i, x, pos) for i in range(c.num_hidden_layers)])
        k, v = (
            tuple(torch.cat([p[i][j] for p in pieces], 1) for i in range(c.num_hidden_layers))
            for j in (0, 1)
        )
        return ContextKV(k, v, lengths)

    def block_hidden(
        self, ctx: ContextKV, stream: torch.Tensor, anchor: torch.Tensor, first_token: torch.Tensor
    ) -> torch.Tensor:
        """Every slot's final-normed state [N, block_slots, H] (model dtype), as :meth:`draft_one`
        in runs of consecutive blocks within ``SCORE_BUDGET`` elements."""
        c = self.config
        stream, anchor, first_token = check_blocks(
            c.vocab_size, ctx.lengths, stream, anchor, first_token
        )
        B, kv = c.block_slots, c.num_key_value_heads * c.head_dim
        per_key = max(c.num_attention_heads * B, 2 * kv)  # score or gathered elements per key
        out = torch.empty(len(stream), B, c.hidden_size, dtype=self.dtype, device=self.device)
        j, keys = 0, anchor.tolist()
        while j < len(keys):
            k, longest = j + 1, keys[j]
            while (
                k < len(keys)
                and (k + 1 - j) * per_key * (max(longest, keys[k]) + B) <= SCORE_BUDGET
            ):
                longest, k = max(longest, keys[k]), k + 1
            out[j:k] = self._blocks(ctx, stream[j:k], anchor[j:k], first_token[j:k])
            j = k
        return out

    def _blocks(self, ctx: ContextKV, stream, anchor, first_token) -> torch.Tensor:
        c, n, B = self.config, len(anchor), self.config.block_slots
        stream, anchor = stream.to(ctx.k[0].device), anchor.to(self.device)
        T = int(anchor.max())
        tokens = torch.full((n, B), c.mask_token_id, device=self.device)
        tokens[:, 0] = first_token.to(self.device)
        pos = anchor[:, None] + torch.arange(B, device=self.device)  # [n, B]
        visible = torch.arange(T, device=self.device)[None, :] < anchor[:, None]  # [n, T]
        mask = torch.cat((visible, visible.new_ones(n, B)), 1)[:, None, :].expand(n, B, T + B)
        x = self.embed(tokens)  # [n, B, H]
        for i in range(c.num_hidden_layers):
            h = self.norm(x, f"layers.{i}.input_layernorm")
            kb, vb = self.key_value(i, h, pos)  # [n, B, kv, d]
            k = torch.cat((ctx.k[i][stream, :T], kb), 1)  # [n, T + B, kv, d]
            v = torch.cat((ctx.v[i][stream, :T], vb), 1)
            out = self.attend(self.query(i, h, pos), k, v, mask)
            x = x + self.proj(f"layers.{i}.self_attn.o_proj", out)
            x = x + self.mlp(i, x)
        return self.norm(x, "norm")

    def draft(
        self, ctx: ContextKV, stream: torch.Tensor, anchor: torch.Tensor, first_token: torch.Tensor
    ) -> Blocks:
        """The drafted slots' ``U = hf @ lm_head^T`` [N, B, Vd] (row k predicts ids[p+k+1]) and
        hf [N, B, H], fp32, of block n on ``stream[n]`` at ``anchor[n]`` from ``first_token[n]``."""
        hf = self.block_hidden(ctx, stream, anchor, first_token)[:, self.config.first_slot :]
        U = self.matmul(LM_HEAD, hf)
        return Blocks(U.float(), hf.float(), torch.as_tensor(first_token).long().to(self.device))

    def draft_one(self, ctx: ContextKV, stream: int, anchor: int, first_token: int) -> Blocks:
        """One block, written to be read (docs/qwen3-dspark.md): ``[first_token, mask, ...]`` at
        positions p.. (p = ``anchor``) attend to the context j < p of ``stream`` and the block."""
        c, p = self.config, anchor
        if not 0 <= p <= int(ctx.lengths[stream]):
            raise ValueError("the anchor p must satisfy 0 <= p <= its stream's context length")
        tokens = torch.full((c.block_slots,), c.mask_token_id, device=self.device)
        tokens[0] = first_token
        pos = p + torch.arange(c.block_slots, device=self.device)
        x = self.embed(tokens)  # [B, H]
        for i in range(c.num_hidden_layers):
            h = self.norm(x, f"layers.{i}.input_layernorm")
            k_blk, v_blk = self.key_value(i, h, pos)  # [B, kv, d]
            k = torch.cat((ctx.k[i][stream, :p], k_blk))  # [p + B, kv, d]: every key visible
            v = torch.cat((ctx.v[i][stream, :p], v_blk))
            x = x + self.proj(
                f"layers.{i}.self_attn.o_proj", self.attend(self.query(i, h, pos), k, v)
            )
            x = x + self.mlp(i, x)
        hf = self.norm(x, "norm")[c.first_slot :]
        U = self.matmul(LM_HEAD, hf)
        return Blocks(
            U[None].float(), hf[None].float(), torch.tensor([first_token], device=self.device)
        )

    def causal_hidden(self, ids: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """The layers as a causal decoder over ids [S, T] -> [S, T, depth, H] fp32 (interface.py)."""
        stream = CausalStream(self, ids, torch.float32, depth)
        S, T, _ = stream.shape
        return stream.rows(0, T).unflatten(-1, (len(stream.layers), -1))


class CausalStream(CausalRows):
    """:meth:`Qwen3DSpark.causal_hidden` a range of positions at a time over a KV cache per step."""

    def cache_dims(self, c: Qwen3DSparkConfig) -> tuple[tuple[int, ...], ...]:
        return (c.num_key_value_heads, c.head_dim), (c.num_key_value_heads, c.head_dim)

    def compute(self, t0: int, t1: int) -> torch.Tensor:
        per_query = self.model.config.num_attention_heads * t1 * self.shape[0]
        step = max(1, SCORE_BUDGET // per_query)
        return torch.cat([self._rows(a, min(a + step, t1)) for a in range(t0, t1, step)], 1)

    def _rows(self, t0: int, t1: int) -> torch.Tensor:
        m = self.model
        pos = torch.arange(t0, t1, device=m.device)
        mask = torch.arange(t1, device=m.device)[None, :] <= pos[:, None]  # [t, t1]
        x = m.embed(self.ids[:, t0:t1].to(m.device))  # [S, t, H]
        outs = []
        for i, (k, v) in zip(self.layers, self._cache, strict=True):
            h = m.norm(x, f"layers.{i}.input_layernorm")
            k[:, t0:t1], v[:, t0:t1] = m.key_value(i, h, pos)
            out = m.attend(m.query(i, h, pos), k[:, :t1], v[:, :t1], mask)
            x = x + m.proj(f"layers.{i}.self_attn.o_proj", out)
            x = x + m.mlp(i, x)
            outs.append(x.to(self.dtype))
        return torch.stack(outs, dim=2).flatten(2)


# The FLOP model (docs/eval-drift.md, "FLOP model"), counted as the DSpark-MLA one.


def context_flops(c: Qwen3DSparkConfig) -> float:
    """One context position: fc, then every layer's key and value projections."""
    kv = 2 * c.num_key_value_heads * c.head_dim
    return 2.0 * (c.aux_size * c.hidden_size + c.num_hidden_layers * c.hidden_size * kv)


def _layer(c: Qwen3DSparkConfig, keys: int) -> int:
    """Multiply-adds of one layer at one position attending to ``keys`` keys."""
    H, q = c.hidden_size, c.num_attention_heads * c.head_dim
    kv = 2 * c.num_key_value_heads * c.head_dim
    return H * (q + kv) + q * H + 3 * H * c.intermediate_size + 2 * keys * q


def drafted_flops(c: Qwen3DSparkConfig, anchor: torch.Tensor) -> float:
    """Blocks at ``anchor`` [N]: every slot's layers, the drafted ones' lm_head and Markov head."""
    S, B = c.block_slots, c.block_size
    head = (c.hidden_size + c.markov_rank) * c.draft_vocab_size
    return sum(
        2.0 * (S * c.num_hidden_layers * _layer(c, p + S) + B * head) for p in anchor.tolist()
    )


def causal_flops(c: Qwen3DSparkConfig, T: int) -> float:
    """One stream's causal pass over T positions, one layer step per target aux layer."""
    q = c.num_attention_heads * c.head_dim
    return 2.0 * c.num_target_layers * (T * _layer(c, 0) + 2 * q * T * (T + 1) // 2)
