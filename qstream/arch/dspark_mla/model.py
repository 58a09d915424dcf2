"""The DSpark-MLA draft's forward (docs/model.md), one code path for every precision:
weights and activations in ``dtype``, matmuls accumulating in fp32, RMSNorm, RoPE, the attention
scores and softmax in fp32, rounded back to ``dtype``.

>>> model = DSpark(config, weights)                      # weights: name -> tensor, incl. lm_head
>>> ctx = model.context(aux, lengths)                    # aux [S, T, A]: once per set of streams
>>> blocks = model.draft(ctx, stream, anchor, first_token)   # U [N, B, V], hf [N, B, H]
>>> rows = CausalStream(model, ids).rows(0, 128)         # causal mode: [S, 128, L*H]

Top to bottom, the readable core: the building blocks, one decoder :class:`Layer`, the model
with :meth:`DSpark.draft_one`, the forward of one block, and the FLOP model.  The context's
per-layer cache is what an MLA KV cache holds (the normed kv_lora latent and the rotated rope
key); ``kv_b_proj`` expands it when a block attends to it (expansion, not weight absorption:
docs/model.md's ``kv_b(RMS(latent))``).

Below it, the memory machinery, which computes the same within a memory budget.
:meth:`DSpark.draft` takes N blocks in one pass: blocks packed R rows x M slots, a row holding
blocks of one stream so that its context keys are expanded once (a per-slot mask hides keys at
or after each anchor); rows taken a few at a time so one score tensor stays within
``SCORE_BUDGET``; a long context attended in key chunks with an online softmax.  Causal mode
takes queries in chunks, or is streamed over its MLA cache (:class:`CausalStream`).
tests/test_model_forward.py checks ``draft`` against ``draft_one``,
tests/test_sensitivity_context.py the chunked paths against the one-pass ones, and
tests/test_causal_stream.py the stream against ``causal_hidden``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from qstream.arch.dspark_mla import DSparkConfig, check_tensors, load_config, load_weights
from qstream.arch.family import check_blocks
from qstream.arch.interface import LM_HEAD, AuxChunks, Blocks, causal_layers
from qstream.arch.weights import CausalRows, ComputeWeights, embedding, inv_freq, rms_norm, swiglu

CONTEXT_ELEMENTS = 1 << 26  # aux elements converted and projected at a time by context()


# ---------------------------------------------------------------------------------------------
# Building blocks


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float = 1.0
) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2j], x[2j+1])`` of x [..., T, d] by ``pos * inv_freq[j]``
    (DeepSeek layout, not half-split), with cos and sin scaled by ``mscale``
    (:attr:`DSparkConfig.rope_mscale`, 1 in every preset).  ``positions`` broadcasts against
    x's [..., T]."""
    angle = positions.to(torch.float32)[..., None] * inv_freq  # [..., T, d/2]
    # as vLLM 0.32's DeepseekScalingRotaryEmbedding._compute_cos_sin_cache (vllm/model_executor/
    # layers/rotary_embedding/deepseek_scaling_rope.py) builds them for the K3 MLA: fp32 cos
    # and sin, each times the Python float mscale (by 1.0 exactly: unchanged when it is 1)
    cos, sin = angle.cos() * mscale, angle.sin() * mscale
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    pairs = xf.unflatten(-1, (-1, 2))  # [..., T, d/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# The context cache


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


@dataclass(frozen=True)
class ContextCache:
    """Per-stream context, computed once and shared by every block drafted on those streams."""

    latent: tuple[torch.Tensor, ...]  # per layer [S, T, kv_lora], after kv_a_layernorm
    rope_key: tuple[torch.Tensor, ...]  # per layer [S, T, rope], rotated at positions 0..T-1
    lengths: torch.Tensor  # [S] valid context positions per stream


# ---------------------------------------------------------------------------------------------
# One decoder layer: MLA attention and a SwiGLU MLP


def _layer_weight(name: str) -> property:
    """A :class:`Layer` attribute that reads ``layers.{i}.<name>.weight`` in the compute dtype
    (the norms; projections go through :meth:`Layer.proj`)."""
    return property(lambda self: self.weights[f"layers.{self.index}.{name}.weight"])


class Layer:
    """Decoder layer ``i``'s tensors and the pieces of its forward.  Every method works on any
    leading shape [..., T, ...]; the attention itself (which keys a query sees) is the
    caller's: :meth:`DSpark.draft_one`, or the batched :func:`draft_packed`."""

    input_layernorm = _layer_weight("input_layernorm")
    q_a_layernorm = _layer_weight("self_attn.q_a_layernorm")
    kv_a_layernorm = _layer_weight("self_attn.kv_a_layernorm")
    post_attention_layernorm = _layer_weight("post_attention_layernorm")

    def __init__(
        self,
        config: DSparkConfig,
        weights: ComputeWeights,
        i: int,
        inv_freq: torch.Tensor,
    ):
        self.config, self.weights, self.index, self.inv_freq = config, weights, i, inv_freq

    def input_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.input_layernorm, self.config.rms_norm_eps)

    def proj(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x @ W^T`` for projection ``layers.{i}.<name>.weight``, in row chunks if upcast."""
        return self.weights.linear(f"layers.{self.index}.{name}.weight", x)

    def attention_output(self, out: torch.Tensor) -> torch.Tensor:
        """The heads' concatenated outputs [..., n*dv] -> [..., H] (o_proj)."""
        return self.proj(out, "self_attn.o_proj")

    def query(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """h [..., T, H] -> q [..., T, n, nope+rope] with RoPE on the rope part."""
        c = self.config
        qa = rms_norm(self.proj(h, "self_attn.q_a_proj"), self.q_a_layernorm, c.rms_norm_eps)
        q = self.proj(qa, "self_attn.q_b_proj")
        q = q.unflatten(-1, (c.num_attention_heads, c.qk_head_dim))  # [..., T, n, dk]
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_rope = apply_rope(
            q_rope.transpose(-2, -3), pos[..., None, :], self.inv_freq, c.rope_mscale
        )
        return torch.cat((q_nope, q_rope.transpose(-2, -3)), dim=-1)

    def latent(self, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [..., T, H] -> (latent [..., T, kv_lora] normed, rope key [..., T, rope] rotated):
        what an MLA KV cache holds."""
        c = self.config
        kv = self.proj(h, "self_attn.kv_a_proj_with_mqa")
        latent, k_rope = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, self.kv_a_layernorm, c.rms_norm_eps)
        return latent, apply_rope(k_rope, pos, self.inv_freq, c.rope_mscale)

    def expand(
        self, latent: torch.Tensor, k_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [..., T, kv_lora], k_rope [..., T, rope] -> k [..., n, T, dk], v [..., n, T, dv];
        the rope key is shared by all heads."""
        c = self.config
        kv = self.proj(latent, "self_attn.kv_b_proj")
        kv = kv.unflatten(-1, (c.num_attention_heads, -1)).transpose(-2, -3)  # [..., n, T, nope+v]
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_rope = k_rope.unsqueeze(-3).expand(*k_nope.shape[:-1], c.qk_rope_head_dim)
        return torch.cat((k_nope, k_rope), dim=-1), v

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The residual update of the MLP: ``down(silu(gate(RMS(x))) * up(RMS(x)))``."""
        h = rms_norm(x, self.post_attention_layernorm, self.config.rms_norm_eps)
        return swiglu(h, "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", self.proj)


# ---------------------------------------------------------------------------------------------
# The model


class DSpark:
    """A DSpark draft computing in ``dtype``: ``weights`` maps every name of :func:`tensor_shapes`
    plus ``lm_head.weight`` [V, H] to a tensor of any float dtype, each held once
    (:class:`~qstream.arch.weights.ComputeWeights`).  Nothing is mutated after construction."""

    def __init__(
        self,
        config: DSparkConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        check_tensors(
            config,
            {k: tuple(v.shape) for k, v in weights.items()},
            "weights",
            extra={LM_HEAD: (config.vocab_size, config.hidden_size)},
        )
        self.config, self.dtype = config, dtype
        self.w = ComputeWeights(weights, dtype, device)
        self.device = self.w.device
        yarn = config.rope_parameters
        self.inv_freq = inv_freq(config.qk_rope_head_dim, config.rope_theta, yarn).to(self.device)
        self.scale = config.softmax_scale
        self.layers = tuple(
            Layer(config, self.w, i, self.inv_freq) for i in range(config.num_hidden_layers)
        )

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return embedding(self.w, "embed_tokens.weight", tokens)

    def head(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Last layer's output x [..., H] -> (U = hf @ lm_head^T [..., V], hf [..., H])."""
        hf = rms_norm(x, self.w["final_norm.weight"], self.config.rms_norm_eps)
        return self.w.linear(LM_HEAD, hf), hf

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """fp32 ``q . k * scale`` (q [..., Tq, dk], k [..., Tk, dk]) -> [..., Tq, Tk]."""
        return (q.float() @ k.float().transpose(-1, -2)) * self.scale

    def attend(self, scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(scores) in fp32, rounded to the model's dtype, times v [..., Tk, dv]."""
        return torch.softmax(scores, dim=-1).to(self.dtype) @ v

    def context(
        self, aux: torch.Tensor | AuxChunks, lengths: torch.Tensor | None = None
    ) -> ContextCache:
        """aux [S, T, A] (the target_layer_ids' hidden states, concatenated per position) ->
        every layer's context latent and rope key at positions 0..T-1; ``lengths`` [S] marks
        right padding (default: all T valid).  Converted and projected ``CONTEXT_ELEMENTS`` at
        a time: a tensor a few streams at a time, :class:`AuxChunks` a few positions."""
        c = self.config
        if len(aux.shape) != 3 or aux.shape[-1] != c.aux_size:
            raise ValueError(f"aux must be [S, T, {c.aux_size}], got {list(aux.shape)}")
        S, T, _ = aux.shape
        lengths = torch.full((S,), T) if lengths is None else torch.as_tensor(lengths).cpu()
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
            tuple(_cat([piece[i][j] for piece in pieces], dim) for i in range(len(self.layers)))
            for j in (0, 1)
        )
        return ContextCache(latent, rope_key, lengths.to(torch.int64))

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
        return [layer.latent(ctx, pos) for layer in self.layers]

    def draft_one(self, ctx: ContextCache, stream: int, anchor: int, first_token: int) -> Blocks:
        """The forward of one block, written to be read (docs/model.md): tokens
        ``[first_token, mask, ..., mask]`` at positions p..p+B-1 (p = ``anchor``) attend to the
        context j < p of stream ``stream`` and to the whole block, with no causal mask inside."""
        c, B, p = self.config, self.config.block_size, anchor
        if not 0 <= p <= int(ctx.lengths[stream]):
            raise ValueError("the anchor p must satisfy 0 <= p <= its stream's context length")
        tokens = torch.full((B,), c.mask_token_id, device=self.device)
        tokens[0] = first_token
        pos = p + torch.arange(B, device=self.device)  # [B]
        x = self.embed(tokens)  # [B, H]
        for layer, latent, rope_key in zip(self.layers, ctx.latent, ctx.rope_key):
            h = layer.input_norm(x)
            q = layer.query(h, pos).transpose(0, 1)  # [n, B, dk]
            k_ctx, v_ctx = layer.expand(latent[stream, :p], rope_key[stream, :p])  # [n, p, d]
            k_blk, v_blk = layer.expand(*layer.latent(h, pos))  # [n, B, d]
            k, v = torch.cat((k_ctx, k_blk), dim=1), torch.cat((v_ctx, v_blk), dim=1)  # [n, p+B, d]
            out = self.attend(self.scores(q, k), v)  # [n, B, dv]: every key is visible
            x = x + layer.attention_output(out.transpose(0, 1).flatten(1))  # [B, H]
            x = x + layer.mlp(x)
        U, hf = self.head(x)  # [B, V], [B, H]
        return Blocks(
            U[None].float(), hf[None].float(), torch.tensor([first_token], device=self.device)
        )

    def draft(
        self,
        ctx: ContextCache,
        stream: torch.Tensor,
        anchor: torch.Tensor,
        first_token: torch.Tensor,
        key_chunk: int | None = None,
    ) -> Blocks:
        """Block n is :meth:`draft_one` on stream ``stream[n]`` at anchor ``anchor[n]`` = p from
        token ``first_token[n]`` = ids[p], all computed at once by :func:`draft_packed` (blocks
        given grouped by stream skip a final gather); a context longer than ``key_chunk`` keys
        (default: within :data:`SCORE_BUDGET`) is attended a chunk at a time."""
        stream, anchor, first_token = check_blocks(
            self.config.vocab_size, ctx.lengths, stream, anchor, first_token
        )
        U, hf = draft_packed(self, ctx, stream, anchor, first_token, key_chunk)
        return Blocks(U.float(), hf.float(), first_token.to(self.device))

    # -- causal mode: the draft's layers as an ordinary decoder (the "boot" aux regime) -------

    def attention_causal(
        self, i: int, h: torch.Tensor, pos: torch.Tensor, query_chunk: int | None = None
    ) -> torch.Tensor:
        """Layer i's MLA attention as an ordinary causal decoder: h [S, T, H] (input-normed) at
        positions pos [T] -> o_proj output [S, T, H] (``query_chunk``: :func:`causal_attention`)."""
        layer = self.layers[i]
        q = layer.query(h, pos).transpose(1, 2)  # [S, n, T, dk]
        k, v = layer.expand(*layer.latent(h, pos))  # [S, n, T, dk], [S, n, T, dv]
        out = causal_attention(self, q, k, v, query_chunk)  # [S, n, T, dv]
        return layer.attention_output(out.transpose(1, 2).flatten(2))  # [S, T, n*dv] -> [S, T, H]

    def causal_hidden(
        self, ids: torch.Tensor, depth: int | None = None, query_chunk: int | None = None
    ) -> torch.Tensor:
        """The draft's layers as a causal decoder over ids [S, T] (right padding is harmless:
        nothing attends forward) -> every layer's output [S, T, depth, H] fp32, the layers in
        :func:`causal_layers`' order (default: each once); at the target's aux depth,
        ``.flatten(2)`` is the "boot" regime's aux (docs/eval-drift.md)."""
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
    """A ready :class:`DSpark` from a checkpoint (:mod:`.checkpoint`), weights and compute in
    ``dtype``: ``load_model("ckpt/")`` borrows the head from ckpt/target_head/,
    ``load_model("ckpt-nvfp4/", target="kimi-k3/", dtype=torch.bfloat16)`` from the target."""
    config = load_config(model_dir)
    return DSpark(config, load_weights(model_dir, target, config), dtype)


# ---------------------------------------------------------------------------------------------
# The FLOP model (docs/eval-drift.md, "FLOP model"): 2 FLOPs per multiply-add of the work the
# draft must do; norms, softmax, masking, upcasts and sampling are not counted.  Its readers:
# the packing below weighs a padding slot against a row's context expansion, eval-drift's
# progress bar takes its ETA from the work left, and evals/ divide it by a pass's seconds.


def expand_flops(c: DSparkConfig) -> float:
    """One context key expanded to every head's key and value, in every layer (kv_b_proj)."""
    L, n = c.num_hidden_layers, c.num_attention_heads
    return 2.0 * L * c.kv_lora_rank * n * (c.qk_nope_head_dim + c.v_head_dim)


def context_flops(c: DSparkConfig) -> float:
    """One context position: the context projection, then each layer's latent and rope key
    (kv_a_proj_with_mqa) and its expansion."""
    latent = c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)
    return 2.0 * (c.aux_size * c.hidden_size + c.num_hidden_layers * latent) + expand_flops(c)


def position_flops(c: DSparkConfig, keys: int) -> float:
    """One drafted position that attends to ``keys`` keys (its context plus the block): every
    layer's projections and attention, then lm_head and the Markov head."""
    return 2.0 * (
        c.num_hidden_layers * _layer_multiply_adds(c, keys)
        + (c.hidden_size + c.markov_rank) * c.vocab_size
    )


def causal_flops(c: DSparkConfig, T: int) -> float:
    """One stream's causal pass over T positions (the boot regime's aux states, one layer step
    per target aux layer): every step at every position, position t attending to the t + 1 keys
    up to itself."""
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
    """Blocks at ``anchor`` [N]: their B positions each, each attending to its context and the
    block (no context projection)."""
    B = c.block_size
    return sum(B * position_flops(c, p + B) for p in anchor.tolist())


def blocks_flops(c: DSparkConfig, stream: torch.Tensor, anchor: torch.Tensor) -> float:
    """Blocks at ``anchor`` of ``stream`` [N]: their B positions each, plus each stream's
    context up to its longest anchor, computed once (a batch's padding is not useful work)."""
    context = sum(longest_anchors(stream, anchor).values())
    return drafted_flops(c, anchor) + context * context_flops(c)


def longest_anchors(stream: torch.Tensor, anchor: torch.Tensor) -> dict[int, int]:
    """Each stream's largest anchor among blocks (stream, anchor) [N]: the context it needs."""
    longest: dict[int, int] = {}
    for s, p in zip(stream.tolist(), anchor.tolist()):
        longest[s] = max(longest.get(s, 0), p)
    return longest


# =============================================================================================
# The memory machinery: the same arithmetic within a memory budget

# Budget of one score tensor (float32 elements): draft's [rows, n, M*B, keys] and causal mode's
# [S, n, queries, T].
SCORE_BUDGET = 1 << 25
MIN_KEY_CHUNK = 256  # keys per chunk never fall below this, whatever the budget says

# ---------------------------------------------------------------------------------------------
# Drafting many blocks at once


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


# ---------------------------------------------------------------------------------------------
# Keys a chunk at a time


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


# ---------------------------------------------------------------------------------------------
# Causal mode: queries in chunks, or streamed over the MLA cache


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


class CausalStream(CausalRows):
    """The draft's layers as a causal decoder streamed over a long token stream a range of
    positions at a time (the boot aux regime at long context, docs/context-sweep.md "Memory"):
    where :meth:`DSpark.causal_hidden` returns all of ``[S, T, L, H]`` at once (19 GB of fp32
    for one 131,072-token stream at K3), this keeps per layer only what an MLA KV cache holds
    and attends to it in key chunks (:func:`cached_causal_attention`), equal to
    ``causal_hidden`` to fp32 rounding (tests/test_causal_stream.py).  ``rows(t0, t1)``:
    :class:`~qstream.arch.weights.CausalRows`."""

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
