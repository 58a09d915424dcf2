"""The DSpark-MLA draft's reference forward (docs/model.md), one code path for every precision:
weights and activations in ``dtype``, matmuls accumulating in fp32, RMSNorm, RoPE, the attention
scores and softmax in fp32, rounded back to ``dtype``.

>>> model = DSpark(config, weights)                      # weights: name -> tensor, incl. lm_head
>>> ctx = model.context(aux, lengths)                    # aux [S, T, A]: once per set of streams
>>> blocks = model.draft(ctx, stream, anchor, first_token)   # U [N, B, V], hf [N, B, H]

Top to bottom: the building blocks, one decoder :class:`Layer`, then the model with
:meth:`DSpark.draft_one`, the forward of one block; :meth:`DSpark.draft` computes it for many
blocks at once (:mod:`.engine`).  The context's per-layer cache is what an MLA KV cache holds
(the normed kv_lora latent and the rotated rope key); ``kv_b_proj`` expands it when a block
attends to it (expansion, not weight absorption: docs/model.md's ``kv_b(RMS(latent))``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from qstream.arch.blocks import rms_norm, swiglu
from qstream.arch.dspark_mla import engine
from qstream.arch.dspark_mla.config import DSparkConfig
from qstream.arch.dspark_mla.tensors import check_tensors
from qstream.arch.family import check_blocks
from qstream.arch.interface import LM_HEAD, AuxChunks, Blocks, causal_layers
from qstream.arch.weights import ComputeWeights, embedding

CONTEXT_ELEMENTS = 1 << 26  # aux elements converted and projected at a time by context()


# ---------------------------------------------------------------------------------------------
# Building blocks


def yarn_inv_freq(config: DSparkConfig) -> torch.Tensor:
    """YaRN inverse frequencies of the rope dims (fp32, [rope/2]), as DeepSeek-V3 computes them:
    interpolated (``/factor``) below a linear ramp between ``low`` and ``high``, extrapolated
    above it."""
    yarn, d, base = config.rope_parameters, config.qk_rope_head_dim, config.rope_theta
    orig = yarn.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = float(max(math.floor(correction_dim(yarn.beta_fast)), 0))
    high = float(min(math.ceil(correction_dim(yarn.beta_slow)), d - 1))
    if low == high:
        high += 0.001  # DeepSeek's guard against a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (yarn.factor * pos_freqs)
    return interpolated * ramp + extrapolated * (1 - ramp)


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
    caller's: :meth:`DSpark.draft_one`, or the batched :mod:`engine`."""

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
        self.inv_freq = yarn_inv_freq(config).to(self.device)
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
        token ``first_token[n]`` = ids[p], all computed at once by :mod:`.engine` (blocks given
        grouped by stream skip a final gather); a context longer than ``key_chunk`` keys
        (default: within :data:`engine.SCORE_BUDGET`) is attended a chunk at a time."""
        stream, anchor, first_token = check_blocks(
            self.config.vocab_size, ctx.lengths, stream, anchor, first_token
        )
        U, hf = engine.draft_packed(self, ctx, stream, anchor, first_token, key_chunk)
        return Blocks(U.float(), hf.float(), first_token.to(self.device))

    # -- causal mode: the draft's layers as an ordinary decoder (the "boot" aux regime) -------

    def attention_causal(
        self, i: int, h: torch.Tensor, pos: torch.Tensor, query_chunk: int | None = None
    ) -> torch.Tensor:
        """Layer i's MLA attention as an ordinary causal decoder: h [S, T, H] (input-normed) at
        positions pos [T] -> o_proj output [S, T, H] (``query_chunk``: engine.causal_attention)."""
        layer = self.layers[i]
        q = layer.query(h, pos).transpose(1, 2)  # [S, n, T, dk]
        k, v = layer.expand(*layer.latent(h, pos))  # [S, n, T, dk], [S, n, T, dv]
        out = engine.causal_attention(self, q, k, v, query_chunk)  # [S, n, T, dv]
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
