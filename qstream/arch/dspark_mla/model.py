"""The DSpark-MLA draft's forward (docs/model.md), one code path for every precision: weights and
activations in ``dtype``, matmuls accumulating in fp32, RMSNorm, RoPE, attention scores and
softmax in fp32, rounded back to ``dtype``.

>>> model = DSpark(config, weights)                      # weights: name -> tensor, incl. lm_head
>>> ctx = model.context(aux, lengths)                    # aux [S, T, A]: once per set of streams
>>> blocks = model.draft(ctx, stream, anchor, first_token)   # U [N, B, V], hf [N, B, H]

Top to bottom: the readable core (:class:`Layer`, :meth:`DSpark.draft_one`) and the FLOP model;
then the memory machinery computing the same within ``SCORE_BUDGET`` (docs/eval-drift.md,
"Memory"): blocks packed in rows of one stream, key chunks with an online softmax, causal mode
streamed over its MLA cache.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from qstream.arch.dspark_mla import DSparkConfig, check_tensors, load_config, load_weights
from qstream.arch.family import check_blocks, context_lengths
from qstream.arch.interface import LM_HEAD, AuxChunks, Blocks, causal_layers
from qstream.arch.weights import (
    CausalRows,
    ComputeWeights,
    Draft,
    fp8_round_trip,
    inv_freq,
    rms_norm,
    swiglu,
)
from qstream.serving import KVCache

CONTEXT_ELEMENTS = 1 << 26  # aux elements converted and projected at a time by context()


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float = 1.0
) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2j], x[2j+1])`` of x [..., T, d] by ``pos * inv_freq[j]``
    (DeepSeek layout), fp32 cos and sin times ``mscale`` as vLLM 0.32's
    DeepseekScalingRotaryEmbedding._compute_cos_sin_cache (vllm/model_executor/layers/
    rotary_embedding/deepseek_scaling_rope.py) builds them."""
    angle = positions.to(torch.float32)[..., None] * inv_freq  # [..., T, d/2]
    cos, sin = angle.cos() * mscale, angle.sin() * mscale
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    pairs = xf.unflatten(-1, (-1, 2))  # [..., T, d/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


@dataclass(frozen=True)
class ContextCache:
    """Per-stream context, computed once and shared by every block drafted on those streams."""

    latent: tuple[torch.Tensor, ...]  # per layer [S, T, kv_lora], after kv_a_layernorm
    rope_key: tuple[torch.Tensor, ...]  # per layer [S, T, rope], rotated at positions 0..T-1
    lengths: torch.Tensor  # [S] valid context positions per stream


class Layer:
    """Decoder layer ``i``'s pieces (MLA attention, SwiGLU MLP), on any leading shape; which keys
    a query sees is the caller's.  The fp32 reference expands every key and value by kv_b_proj;
    a bf16 model attends as vLLM 0.32.0's K3 decode path does (``absorbed``,
    docs/eval-drift.md, "Serving configurations"): the query's nope part times W_UK, one shared
    key per position (the cached latent and rope key), the latent output times W_UV."""

    def __init__(
        self, config: DSparkConfig, weights: ComputeWeights, i: int, inv_freq, kv: KVCache
    ):
        self.config, self.weights, self.index, self.inv_freq = config, weights, i, inv_freq
        self.absorbed = torch.finfo(weights.dtype).bits < 32
        self.kv = kv
        self.attention = f"layers.{i}.self_attn"
        self._split: tuple[torch.Tensor, torch.Tensor] | None = None

    def norm(self, x: torch.Tensor, name: str = "input_layernorm") -> torch.Tensor:
        w = self.weights[f"layers.{self.index}.{name}.weight"]
        return rms_norm(x, w, self.config.rms_norm_eps)

    input_norm = norm

    def proj(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.weights.linear(f"layers.{self.index}.{name}.weight", x)

    def attention_output(self, out: torch.Tensor) -> torch.Tensor:
        """Every head's output [..., n*dv] (absorbed: [..., n*kv_lora], times W_UV first, as
        ``_v_up_proj``) -> o_proj's [..., H]."""
        if self.absorbed:
            c, (_, w_uv) = self.config, self.split()
            out = out.unflatten(-1, (c.num_attention_heads, c.kv_lora_rank))  # [..., n, L]
            out = torch.einsum("...nl,nvl->...nv", out, w_uv).flatten(-2)
        return self.proj(out, "self_attn.o_proj")

    def split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj [n*(nope+v), L] in the compute dtype as W_UK [n, nope, L] and W_UV [n, v, L]
        (vLLM's ``split_kv_b_proj``, vllm/model_executor/layers/attention/mla_attention.py; its
        bmms take bf16 operands and accumulate in fp32, as torch's do)."""
        if self._split is None:
            c = self.config
            w = self.weights[f"layers.{self.index}.self_attn.kv_b_proj.weight"]
            w = w.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
            w_uk, w_uv = w.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
            self._split = (w_uk.contiguous(), w_uv.contiguous())
        return self._split

    def query(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """h [..., T, H] -> q [..., T, n, nope+rope] with RoPE on the rope part; absorbed:
        vLLM's decode query ``mqa_q = [q_nope @ W_UK_T | q_pe]`` [..., T, n, kv_lora+rope]
        (vllm/models/kimi_k3/nvidia/mla.py, ``_attention``: BMM1 rounded to bf16), which an fp8
        cache's fused ``fused_mla_decode_q_concat_kv_cache_insert`` rounds to float8_e4m3fn times
        ``_q_scale_inv`` and the TRITON_MLA draft backend upcasts back times ``_q_scale``
        (``_decode_concat_cache``).  ``_q_scale`` is the layer's k_scale (a checkpoint's
        kv_cache_scheme stores no q_scale: ``BaseKVCacheMethod.process_weights_after_loading``,
        vllm/model_executor/layers/quantization/kv_cache.py); 1.0 unless scaled."""
        q = self._query(h, pos)
        if not self.absorbed:
            return q
        c = self.config
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        ql = torch.einsum("...np,npl->...nl", q_nope, self.split()[0])
        mqa_q = torch.cat((ql, q_pe), dim=-1)
        if not self.kv.quantized:
            return mqa_q
        q_scale = self.weights.served.cache_scales(self.attention)[0]
        return fp8_round_trip(mqa_q, torch.float8_e4m3fn, q_scale, reciprocal=True)

    def _query(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        c = self.config
        qa = self.norm(self.proj(h, "self_attn.q_a_proj"), "self_attn.q_a_layernorm")
        q = self.proj(qa, "self_attn.q_b_proj")
        q = q.unflatten(-1, (c.num_attention_heads, c.qk_head_dim))  # [..., T, n, dk]
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_rope = apply_rope(
            q_rope.transpose(-2, -3), pos[..., None, :], self.inv_freq, c.rope_mscale
        )
        return torch.cat((q_nope, q_rope.transpose(-2, -3)), dim=-1)

    def latent(
        self, h: torch.Tensor, pos: torch.Tensor, context: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [..., T, H] -> (latent [..., T, kv_lora] normed, rope key [..., T, rope] rotated):
        what an MLA KV cache holds, one entry under one k_scale.  An fp8 cache's write divides
        the ``context`` rows by it (``_precompute_fused_context_kv``: ``_context_kv_scales``, as
        ``concat_and_cache_mla``'s ``scaled_convert`` does) and multiplies a block's own by its
        fp32 reciprocal (``fused_mla_decode_q_concat_kv_cache_insert``, ``_k_scale_inv``)."""
        c = self.config
        kv = self.proj(h, "self_attn.kv_a_proj_with_mqa")
        latent, k_rope = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        latent = self.norm(latent, "self_attn.kv_a_layernorm")
        k_rope = apply_rope(k_rope, pos, self.inv_freq, c.rope_mscale)
        served = self.weights.served
        if served.observe_cache is not None:
            served.observe_cache(self.attention, torch.cat((latent, k_rope), dim=-1), None)
        if not self.kv.quantized:
            return latent, k_rope
        fp8, k_scale = getattr(torch, str(self.kv.dtype)), served.cache_scales(self.attention)[0]
        return (  # as every read sees them (docs/eval-drift.md, "KV cache")
            fp8_round_trip(latent, fp8, k_scale, reciprocal=not context),
            fp8_round_trip(k_rope, fp8, k_scale, reciprocal=not context),
        )

    def expand(
        self, latent: torch.Tensor, k_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [..., T, kv_lora], k_rope [..., T, rope] -> k [..., n, T, dk], v [..., n, T, dv];
        absorbed: the one key [..., 1, T, kv_lora+rope] and value [..., 1, T, kv_lora] every head
        reads of the cache (vLLM's ``forward_mqa``)."""
        c = self.config
        if self.absorbed:
            latent = latent.unsqueeze(-3)
            return torch.cat((latent, k_rope.unsqueeze(-3)), dim=-1), latent
        kv = self.proj(latent, "self_attn.kv_b_proj")
        kv = kv.unflatten(-1, (c.num_attention_heads, -1)).transpose(-2, -3)  # [..., n, T, nope+v]
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_rope = k_rope.unsqueeze(-3).expand(*k_nope.shape[:-1], c.qk_rope_head_dim)
        return torch.cat((k_nope, k_rope), dim=-1), v

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x, "post_attention_layernorm")
        return swiglu(h, "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", self.proj)


class DSpark(Draft):
    """A DSpark draft computing in ``dtype``: ``weights`` maps every name of the tensor table plus
    ``lm_head.weight`` [V, H] to a tensor of any float dtype, each held once."""

    upcast_on_cpu = False

    def check(self, config: DSparkConfig, shapes: Mapping[str, tuple[int, ...]]) -> None:
        check_tensors(config, shapes, "weights", {LM_HEAD: (config.vocab_size, config.hidden_size)})

    def setup(self, weights: Mapping[str, torch.Tensor]) -> None:
        c = self.config
        self.inv_freq = inv_freq(c.qk_rope_head_dim, c.rope_theta, c.rope_parameters).to(
            self.device
        )
        self.scale = c.softmax_scale
        self.layers = tuple(
            Layer(c, self.w, i, self.inv_freq, self.kv) for i in range(c.num_hidden_layers)
        )

    def head(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Last layer's output x [..., H] -> (U = hf @ lm_head^T [..., V], hf [..., H])."""
        hf = rms_norm(x, self.w["final_norm.weight"], self.config.rms_norm_eps)
        return self.w.linear(LM_HEAD, hf), hf

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """fp32 ``q . k * scale`` (q [..., Tq, dk], k [..., Tk, dk]) -> [..., Tq, Tk]."""
        return _heads_matmul(q.float(), k.float().transpose(-1, -2)) * self.scale

    def partial_pv(self, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One key chunk's probabilities p [..., Tq, Tk] (model dtype) times v [..., Tk, dv] for
        an :class:`OnlineSoftmax`; absorbed, left in fp32 as TRITON_MLA's accumulator
        (``tl.dot(p.to(v.dtype), v)`` into fp32, vllm/v1/attention/ops/triton_decode_attention.py)."""
        return _heads_matmul(p.float(), v.float()) if self.layers[0].absorbed else p @ v

    def attend(self, scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(scores) in fp32, rounded to the model's dtype, times v [..., Tk, dv]."""
        return _heads_matmul(torch.softmax(scores, dim=-1).to(self.dtype), v)

    def context(
        self, aux: torch.Tensor | AuxChunks, lengths: torch.Tensor | None = None
    ) -> ContextCache:
        """aux [S, T, A] (``lengths`` [S]: right padding) -> every layer's context latent and
        rope key at positions 0..T-1, projected ``CONTEXT_ELEMENTS`` at a time."""
        c = self.config
        S, T, lengths = context_lengths(c.aux_size, aux, lengths)
        if isinstance(aux, torch.Tensor):
            group, dim = max(1, CONTEXT_ELEMENTS // max(1, T * c.aux_size)), 0
            pieces = [self._context_piece(aux[s0 : s0 + group], 0, T) for s0 in range(0, S, group)]
        else:
            step, dim = max(1, CONTEXT_ELEMENTS // max(1, S * c.aux_size)), 1
            pieces = [
                self._context_piece(aux.rows(t0, min(T, t0 + step)), t0, min(T, t0 + step))
                for t0 in range(0, T, step)
            ]
        latent, rope_key = (
            tuple(
                pieces[0][i][j] if len(pieces) == 1 else torch.cat([p[i][j] for p in pieces], dim)
                for i in range(len(self.layers))
            )
            for j in (0, 1)
        )
        return ContextCache(latent, rope_key, lengths)

    def _context_piece(
        self, aux: torch.Tensor, t0: int, t1: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (latent, rope key) of aux [s, t1 - t0, A] at positions t0..t1-1."""
        ctx = rms_norm(
            self.w.linear("context_proj.weight", aux.to(self.device, self.dtype)),
            self.w["context_norm.weight"],
            self.config.rms_norm_eps,
        )  # [s, t, H]
        pos = torch.arange(t0, t1, device=self.device)
        # each layer's own kv_a_proj_with_mqa on ctx, with no input_layernorm (docs/model.md)
        return [layer.latent(ctx, pos, context=True) for layer in self.layers]

    def draft_one(self, ctx: ContextCache, stream: int, anchor: int, first_token: int) -> Blocks:
        """One block, written to be read (docs/model.md): ``[first_token, mask, ...]`` at positions
        p.. (p = ``anchor``) attend to the context j < p of ``stream`` and to the whole block."""
        c, B, p = self.config, self.config.block_size, anchor
        if not 0 <= p <= int(ctx.lengths[stream]):
            raise ValueError("the anchor p must satisfy 0 <= p <= its stream's context length")
        tokens = torch.full((B,), c.mask_token_id, device=self.device)
        tokens[0] = first_token
        pos = p + torch.arange(B, device=self.device)  # [B]
        x = self.embed(tokens)  # [B, H]
        for layer, latent, rope_key in zip(self.layers, ctx.latent, ctx.rope_key):
            h = layer.input_norm(x)
            x = x + self.block_attention(layer, h, pos, latent[stream, :p], rope_key[stream, :p])
            x = x + layer.mlp(x)
        U, hf = self.head(x)  # [B, V], [B, H]
        return Blocks(
            U[None].float(), hf[None].float(), torch.tensor([first_token], device=self.device)
        )

    def block_attention(
        self, layer: Layer, h: torch.Tensor, pos: torch.Tensor, latent, rope_key
    ) -> torch.Tensor:
        """``layer``'s attention of one input-normed block h [B, H] over its context's cache rows
        (latent [p, kv_lora], rope_key [p, rope]) and its own -> [B, H]."""
        q = layer.query(h, pos).transpose(0, 1)  # [n, B, dk]
        k_ctx, v_ctx = layer.expand(latent, rope_key)  # [n, p, d]
        k_blk, v_blk = layer.expand(*layer.latent(h, pos))  # [n, B, d]
        k, v = torch.cat((k_ctx, k_blk), dim=1), torch.cat((v_ctx, v_blk), dim=1)  # [n, p+B, d]
        out = self.attend(self.scores(q, k), v)  # [n, B, dv]: every key is visible
        return layer.attention_output(out.transpose(0, 1).flatten(1))  # [B, H]

    def draft(
        self,
        ctx: ContextCache,
        stream: torch.Tensor,
        anchor: torch.Tensor,
        first_token: torch.Tensor,
        key_chunk: int | None = None,
    ) -> Blocks:
        """Block n is :meth:`draft_one` (``stream[n]``, ``anchor[n]``, ``first_token[n]``), all at
        once in packed rows (:func:`_pack`); contexts longer than ``key_chunk`` keys in chunks."""
        stream, anchor, first_token = check_blocks(
            self.config.vocab_size, ctx.lengths, stream, anchor, first_token
        )
        T_max = int(anchor.max()) if anchor.numel() else 0
        packing = _pack(stream, anchor, _row_cost(self.config, T_max))
        B, n = self.config.block_size, self.config.num_attention_heads
        key_chunk = key_chunk or max(MIN_KEY_CHUNK, SCORE_BUDGET // (n * packing.M * B))
        keys = min(max(T_max, 1), key_chunk)
        rows_per_chunk = max(1, SCORE_BUDGET // max(1, n * packing.M * B * keys))
        chunks = [
            _draft_rows(self, ctx, packing, slice(r0, r0 + rows_per_chunk), first_token, key_chunk)
            for r0 in range(0, packing.R, rows_per_chunk)
        ]
        U, hf = (torch.cat(parts) for parts in zip(*chunks))  # [R*M, B, V], [R*M, B, H]
        slots = packing.slot_of_block
        # [N, B, V] gathers are costly at V = 32k: skipped when slot i holds block i
        if not (
            len(slots) == len(packing.block_of_slot)
            and torch.equal(slots, torch.arange(len(slots)))
        ):
            U, hf = U[slots.to(U.device)], hf[slots.to(U.device)]
        return Blocks(U.float(), hf.float(), first_token.to(self.device))

    # -- causal mode: the draft's layers as an ordinary decoder (the "boot" aux regime) -------

    def attention_causal(
        self, i: int, h: torch.Tensor, pos: torch.Tensor, query_chunk: int | None = None
    ) -> torch.Tensor:
        """Layer i's attention as a causal decoder: h [S, T, H] (input-normed) -> o_proj's
        [S, T, H], ``query_chunk`` queries at a time (default: within the budget)."""
        layer = self.layers[i]
        q = layer.query(h, pos).transpose(1, 2)  # [S, n, T, dk]
        k, v = layer.expand(*layer.latent(h, pos))  # [S, n, T, dk], [S, n, T, dv]
        S, n, T, _ = q.shape
        chunk = query_chunk or max(1, SCORE_BUDGET // max(1, S * n * T))
        outs = []
        for q0 in range(0, T, chunk):
            q1 = min(T, q0 + chunk)
            future = torch.ones(q1 - q0, q1, dtype=torch.bool, device=q.device).triu(q0 + 1)
            scores = self.scores(q[:, :, q0:q1], k[:, :, :q1]).masked_fill(future, float("-inf"))
            outs.append(self.attend(scores, v[:, :, :q1]))  # [S, n, chunk, dv]
        out = torch.cat(outs, dim=2)  # [S, n, T, dv]
        return layer.attention_output(out.transpose(1, 2).flatten(2))  # [S, T, H]

    def causal_hidden(
        self, ids: torch.Tensor, depth: int | None = None, query_chunk: int | None = None
    ) -> torch.Tensor:
        """The layers as a causal decoder over ids [S, T] -> every step's output [S, T, depth, H]
        fp32 (:func:`causal_layers`; ``.flatten(2)``: the boot regime's aux, docs/eval-drift.md)."""
        pos = torch.arange(ids.shape[1], device=self.device)
        x = self.embed(ids.to(self.device))  # [S, T, H]
        outs = []
        for i in causal_layers(len(self.layers), depth):
            layer = self.layers[i]
            x = x + self.attention_causal(i, layer.input_norm(x), pos, query_chunk)
            x = x + layer.mlp(x)
            outs.append(x.float())
        return torch.stack(outs, dim=2)


def load_model(
    model_dir: str | Path, target: str | Path | None = None, dtype: torch.dtype = torch.float32
) -> DSpark:
    """A :class:`DSpark` of a checkpoint in ``dtype``, the lm_head from ``target``."""
    config = load_config(model_dir)
    return DSpark(config, load_weights(model_dir, target, config), dtype)


# The FLOP model (docs/eval-drift.md, "FLOP model"): 2 FLOPs per multiply-add of the work the
# draft must do; norms, softmax, masking, upcasts and sampling are not counted.


def expand_flops(c: DSparkConfig) -> float:
    """One context key expanded to every head's key and value, in every layer (kv_b_proj)."""
    L, n = c.num_hidden_layers, c.num_attention_heads
    return 2.0 * L * c.kv_lora_rank * n * (c.qk_nope_head_dim + c.v_head_dim)


def context_flops(c: DSparkConfig) -> float:
    """One context position: context_proj, each layer's kv_a_proj_with_mqa and expansion."""
    latent = c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)
    return 2.0 * (c.aux_size * c.hidden_size + c.num_hidden_layers * latent) + expand_flops(c)


def position_flops(c: DSparkConfig, keys: int) -> float:
    """One drafted position attending to ``keys`` keys: the layers, lm_head, the Markov head."""
    return 2.0 * (
        c.num_hidden_layers * _layer_multiply_adds(c, keys)
        + (c.hidden_size + c.markov_rank) * c.vocab_size
    )


def causal_flops(c: DSparkConfig, T: int) -> float:
    """One stream's causal pass over T positions, one layer step per target aux layer."""
    per_key = c.num_attention_heads * (c.qk_head_dim + c.v_head_dim)
    return 2.0 * c.num_target_layers * (T * _layer_multiply_adds(c, 0) + per_key * T * (T + 1) // 2)


def _layer_multiply_adds(c: DSparkConfig, keys: int) -> int:
    """Multiply-adds of one layer at one position attending to ``keys`` keys."""
    H, n = c.hidden_size, c.num_attention_heads
    return (
        H * c.q_lora_rank
        + c.q_lora_rank * n * c.qk_head_dim
        + H * (c.kv_lora_rank + c.qk_rope_head_dim)
        + c.kv_lora_rank * n * (c.qk_nope_head_dim + c.v_head_dim)
        + n * c.v_head_dim * H
        + 3 * H * c.intermediate_size
        + keys * n * (c.qk_head_dim + c.v_head_dim)
    )


def drafted_flops(c: DSparkConfig, anchor: torch.Tensor) -> float:
    """Blocks at ``anchor`` [N]: B positions each, attending to the context and block."""
    B = c.block_size
    return sum(B * position_flops(c, p + B) for p in anchor.tolist())


def blocks_flops(c: DSparkConfig, stream: torch.Tensor, anchor: torch.Tensor) -> float:
    """:func:`drafted_flops` plus each stream's context up to its longest anchor, once."""
    context = sum(longest_anchors(stream, anchor).values())
    return drafted_flops(c, anchor) + context * context_flops(c)


def longest_anchors(stream: torch.Tensor, anchor: torch.Tensor) -> dict[int, int]:
    """Each stream's largest anchor among blocks (stream, anchor) [N]."""
    longest: dict[int, int] = {}
    for s, p in zip(stream.tolist(), anchor.tolist()):
        longest[s] = max(longest.get(s, 0), p)
    return longest


# The memory machinery: the same arithmetic within a memory budget.  SCORE_BUDGET bounds one
# score tensor (fp32 elements): draft's [rows, n, M*B, keys], causal mode's [S, n, queries, T].
SCORE_BUDGET = 1 << 25
MIN_KEY_CHUNK = 256  # keys per chunk never fall below this, whatever the budget says


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
    # padding slots get the first block's token
    slot_tokens = first_token.cpu()[pk.block_of_slot.clamp(min=0)].view(-1, pk.M)
    tokens[..., 0] = slot_tokens[rows].to(dev)
    pos = row_anchor[..., None] + torch.arange(B, device=dev)  # [R, M, B]
    # context j < p only: position p itself and everything after it is hidden
    hidden = torch.arange(T, device=dev) >= row_anchor[..., None, None]  # [R, M, 1, T]
    x = model.embed(tokens)  # [R, M, B, H]
    for layer, latent, rope_key in zip(model.layers, ctx.latent, ctx.rope_key):
        h = layer.input_norm(x)
        q = layer.query(h, pos).permute(0, 3, 1, 2, 4)  # [R, n, M, B, dk]
        latent, rope_key = _rows(latent, row_stream, T), _rows(rope_key, row_stream, T)
        if layer.absorbed and T <= key_chunk:
            out = _attend_absorbed(model, layer, q, h, pos, latent, rope_key, hidden)
        else:
            k_blk, v_blk = layer.expand(*layer.latent(h, pos))  # [R, M, n, B, d]
            s_blk = model.scores(q, k_blk.transpose(1, 2))  # [R, n, M, B, B]: no causal mask
            M, B = q.shape[2:4]  # q [R, n, M, B, dk]
            if T <= key_chunk:  # one softmax over the whole context plus the block
                k_ctx, v_ctx = layer.expand(latent, rope_key)  # [R, n, T, d]
                s_ctx = model.scores(q.flatten(2, 3), k_ctx).unflatten(2, (M, B))
                s_ctx = s_ctx.masked_fill(hidden[:, None], float("-inf"))  # [R, n, M, B, T]
                p = torch.softmax(torch.cat((s_ctx, s_blk), dim=-1), dim=-1).to(model.dtype)
                p_ctx, p_blk = p.split([T, B], dim=-1)
                out = (p_ctx.flatten(2, 3) @ v_ctx).unflatten(2, (M, B))  # [R, n, M, B, dv]
                out = out + p_blk @ v_blk.transpose(1, 2)
            else:  # context keys key_chunk at a time; the block's own (never masked) first
                out = _attend_chunked(
                    model, layer, q, s_blk, v_blk, latent, rope_key, hidden, key_chunk
                )
        out = out.permute(0, 2, 3, 1, 4).flatten(3)  # [R, M, B, n*dv]
        x = x + layer.attention_output(out)
        x = x + layer.mlp(x)
    return model.head(x.flatten(0, 1))  # [R*M, B, V], [R*M, B, H]


def _attend_absorbed(
    model: DSpark, layer: Layer, q, h, pos, latent, rope_key, hidden
) -> torch.Tensor:
    """The block's attention as vLLM's decode path (:class:`Layer`): each row's cache holds its
    context and every slot's block, slot m's queries see the context before its anchor and
    its own block, one softmax and one P·V per row -> [R, n, M, B, kv_lora]."""
    M, B = q.shape[2:4]  # q [R, n, M, B, kv_lora+rope]
    lat_b, rope_b = layer.latent(h, pos)  # [R, M, B, kv_lora], [R, M, B, rope]
    k, v = layer.expand(  # [R, 1, T+M*B, kv_lora+rope], [R, 1, T+M*B, kv_lora]
        torch.cat((latent, lat_b.flatten(1, 2)), 1), torch.cat((rope_key, rope_b.flatten(1, 2)), 1)
    )
    own = torch.eye(M, dtype=torch.bool, device=q.device).repeat_interleave(B, dim=1)  # [M, M*B]
    hidden = torch.cat((hidden[:, :, 0], ~own.expand(len(q), M, M * B)), -1)  # [R, M, T+M*B]
    s = model.scores(q.flatten(2, 3), k).unflatten(2, (M, B))  # [R, n, M, B, T+M*B]
    p = torch.softmax(s.masked_fill_(hidden[:, None, :, None], float("-inf")), dim=-1)
    return _heads_matmul(p.to(model.dtype).flatten(2, 3), v).unflatten(2, (M, B))


def _attend_chunked(
    model: DSpark, layer: Layer, q, s_blk, v_blk, latent, rope_key, hidden, key_chunk: int
) -> torch.Tensor:
    M, B = q.shape[2:4]  # q [R, n, M, B, dk]
    softmax = OnlineSoftmax(model.dtype)
    softmax.add(s_blk, lambda p: model.partial_pv(p, v_blk.transpose(1, 2)))  # [R, n, M, B, dv]
    q_flat = q.flatten(2, 3)  # [R, n, M*B, dk]
    for t0 in range(0, latent.shape[1], key_chunk):
        t1 = min(latent.shape[1], t0 + key_chunk)
        k_ctx, v_ctx = layer.expand(latent[:, t0:t1], rope_key[:, t0:t1])  # [R, n, c, d]
        s = model.scores(q_flat, k_ctx).unflatten(2, (M, B))  # [R, n, M, B, c]
        s = s.masked_fill_(hidden[:, None, ..., t0:t1], float("-inf"))
        softmax.add(s, lambda p: model.partial_pv(p.flatten(2, 3), v_ctx).unflatten(2, (M, B)))
    return softmax.result()


class OnlineSoftmax:
    """softmax(scores) · V over key chunks (FlashAttention): running max, sum and output in fp32,
    each chunk's probabilities rounded to ``dtype`` for P·V.  The first chunk must leave every
    query a visible key."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.m: torch.Tensor | None = None

    def add(self, s: torch.Tensor, pv: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Scores ``s`` [..., keys] of one chunk (exponentiated in place); ``pv(p)``: P·V."""
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


def cached_causal_attention(
    model: DSpark,
    layer: Layer,
    q: torch.Tensor,
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    key_chunk: int | None = None,
) -> torch.Tensor:
    """Causal attention of q [S, n, t, dk] at the last t positions of an MLA cache (latent
    [S, T, kv_lora], rope_key [S, T, rope]) -> [S, n, t, dv]; a cache longer than ``key_chunk``
    keys (default: within the budget) is expanded a chunk at a time into an OnlineSoftmax."""
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
        softmax.add(scores(k0, k), lambda p: model.partial_pv(p, v))
    return softmax.result()


class CausalStream(CausalRows):
    """:meth:`DSpark.causal_hidden` streamed a range of positions at a time over a per-layer MLA
    cache (docs/context-sweep.md, "Memory": all of [S, T, L, H] is 19 GB of fp32 for one
    131,072-token stream at K3); equal to it to fp32 rounding."""

    def cache_dims(self, c: DSparkConfig) -> tuple[tuple[int, ...], ...]:
        return (c.kv_lora_rank,), (c.qk_rope_head_dim,)  # the latent and the rope key

    def compute(self, t0: int, t1: int) -> torch.Tensor:
        model = self.model
        pos = torch.arange(t0, t1, device=model.device)
        x = model.embed(self.ids[:, t0:t1].to(model.device))  # [S, t, H]
        outs = []
        for i, (latent, rope_key) in zip(self.layers, self._cache, strict=True):
            layer = model.layers[i]
            h = layer.input_norm(x)
            latent[:, t0:t1], rope_key[:, t0:t1] = layer.latent(h, pos)
            q = layer.query(h, pos).transpose(1, 2)  # [S, n, t, dk]
            out = cached_causal_attention(model, layer, q, latent[:, :t1], rope_key[:, :t1])
            x = x + layer.attention_output(out.transpose(1, 2).flatten(2))  # [S, t, H]
            x = x + layer.mlp(x)
            outs.append(x.to(self.dtype))
        return torch.stack(outs, dim=2).flatten(2)


def _heads_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., n, X, d] @ b [..., n or 1, d, Y]; a b shared by the n heads (the absorbed MLA
    cache) multiplies all heads' rows at once rather than being copied per head."""
    if b.dim() < 3 or b.shape[-3] != 1 or a.shape[-3] == 1 or a.shape[:-3] != b.shape[:-3]:
        return a @ b
    return (a.flatten(-3, -2) @ b.squeeze(-3)).unflatten(-2, a.shape[-3:-1])


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


def _row_cost(c: DSparkConfig, T: int) -> float:
    """A packed row's own work (expanding ``T`` context keys) in slots' work, by the FLOP model."""
    return T * expand_flops(c) / (c.block_size * position_flops(c, T + c.block_size))


def _pack(stream: torch.Tensor, anchor: torch.Tensor, row_cost: float = 0.0) -> _Packing:
    """Group blocks by stream into rows of M slots, M minimising the work: a padding slot costs a
    block's forward, a row ``row_cost`` slots (docs/eval-drift.md, "Batching")."""
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
