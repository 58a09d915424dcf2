"""What every draft architecture's forward computes the same way (docs/eval-drift.md,
"Memory"): weights held once (:class:`ComputeWeights`: a big weight that upcasts exactly stays in
its stored dtype and is upcast per use into one reused buffer, bit-identical to holding it in
fp32), RMSNorm in fp32, the SwiGLU MLP, RoPE, fp8 KV-cache rounding, the Llama/Qwen3 attention
(:class:`DenseDraft`) and the bookkeeping of a causal stream.

>>> w = ComputeWeights(weights, torch.float32)        # bf16 in, fp32 out, each weight held once
>>> w.linear("lm_head.weight", hf)                     # hf @ lm_head^T, upcast in row chunks
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from qstream.arch.interface import EMBED, LM_HEAD, causal_layers
from qstream.serving import KV_CACHES, KVCache

HOLD_ELEMENTS = 1 << 24  # at most this many elements: converted once and held (64 MiB in fp32)
# Upcast row chunks of this many elements (32 MiB in fp32, still in the last-level cache when the
# GEMM reads it), but at least UPCAST_MIN_ROWS rows (docs/eval-drift.md, "Memory").
UPCAST_CHUNK_ELEMENTS = 1 << 23
UPCAST_MIN_ROWS = 1024
# Exact widenings: every value of the first dtype is a value of the second.
EXACT_UPCASTS = {
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64),
    (torch.float32, torch.float64),
}


@dataclass(frozen=True)
class ServedLinears:
    """How a model's linears take their inputs: ``inputs`` maps a weight's name to its input
    quantizer (qstream/formats/activations.py: x -> x dequantized, float32); ``observe(name,
    x)`` sees every input first (qstream/calibration.py); ``fp32_products``: operands of a
    narrower dtype are multiplied upcast to float32 (exact), the sum rounded once.  And how its
    attentions' KV caches are: ``observe_cache(attention, k, v)`` sees what each stores (v None
    where one entry holds both, the MLA latent), ``kv_scales`` each fp8 cache's scales.
    ``products`` maps a weight's name to the whole product served in its place, x -> x @ W^T in
    x's dtype (a quantized drafting head, qstream/formats/head.py)."""

    inputs: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    observe: Callable[[str, torch.Tensor], None] | None = None
    fp32_products: bool = False
    observe_cache: Callable[[str, torch.Tensor, torch.Tensor | None], None] | None = None
    # attention module -> (k_scale, v_scale) as vLLM's _k_scale_float / _v_scale_float; absent: 1.0
    kv_scales: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    products: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)

    def cache_scales(self, attention: str) -> tuple[float, float]:
        return self.kv_scales.get(attention, (1.0, 1.0))


class ComputeWeights(Mapping[str, torch.Tensor]):
    """name -> weight in ``dtype`` on ``device``, each held once (module docstring)."""

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        served: ServedLinears | None = None,
    ):
        self.dtype, self.device = dtype, torch.device(device)
        self.stored = {}
        for k, v in weights.items():  # held as given when big and exactly upcast to dtype
            v = v.detach()
            keep = v.dtype == dtype or (
                (v.dtype, dtype) in EXACT_UPCASTS and v.numel() > HOLD_ELEMENTS
            )
            self.stored[k] = v.to(device=self.device, dtype=None if keep else dtype).contiguous()
        self._buffer: torch.Tensor | None = None  # the reused upcast target
        self.served = served or ServedLinears()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.stored[name].to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.stored)

    def __len__(self) -> int:
        return len(self.stored)

    def linear(self, name: str, x: torch.Tensor, out: torch.dtype | None = None) -> torch.Tensor:
        """``x @ weight^T`` ([..., in] -> [..., rows]) in ``out`` (default the compute dtype), as
        ``served`` says (its observer sees x first).  With an input quantizer, or
        ``fp32_products``, the operands are multiplied in float32 and the sum rounded once;
        else a weight upcast per use is converted into the reused buffer a row chunk at a time.
        Each output column is the fp32 dot product of the whole fp32 weight, though a BLAS may
        order it by the output's shape: at K3's shapes some differ in the last bit
        (docs/eval-drift.md, "Memory")."""
        served = self.served
        if served.observe is not None:
            served.observe(name, x)
        if (product := served.products.get(name)) is not None:
            return product(x).to(out or self.dtype)
        if (quantize := served.inputs.get(name)) is not None:
            # the weight upcast a row chunk at a time: a K3 MLP weight whole in fp32 is half a GB
            return self._chunked(name, quantize(x), torch.Tensor.float).to(out or self.dtype)
        if served.fp32_products:
            return F.linear(x.float(), self.stored[name].float()).to(out or self.dtype)
        if self.upcast_per_use(name):
            y = self._chunked(name, x, self._upcast)
        else:
            y = F.linear(x, self[name])
        return y if out is None else y.to(out)

    def _chunked(self, name: str, x: torch.Tensor, convert: Callable) -> torch.Tensor:
        weight = self.stored[name]
        n, k = weight.shape
        chunk = max(UPCAST_MIN_ROWS, UPCAST_CHUNK_ELEMENTS // k)
        if chunk >= n:
            return F.linear(x, convert(weight))
        out = x.new_empty(*x.shape[:-1], n)
        for r0 in range(0, n, chunk):
            out[..., r0 : r0 + chunk] = F.linear(x, convert(weight[r0 : r0 + chunk]))
        return out

    def borrow(self, name: str) -> torch.Tensor:
        """``name`` in the compute dtype: held, or upcast into the reused buffer (valid until the
        next ``linear`` or ``borrow``)."""
        weight = self.stored[name]
        return self._upcast(weight) if self.upcast_per_use(name) else weight

    def _upcast(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` copied into the reused buffer, grown to the largest request (fresh ones
        page-fault)."""
        if self._buffer is None or self._buffer.numel() < weight.numel():
            self._buffer = None  # freed before its replacement is allocated
            self._buffer = torch.empty(weight.numel(), dtype=self.dtype, device=self.device)
        return self._buffer[: weight.numel()].view(weight.shape).copy_(weight)

    def upcast_per_use(self, name: str) -> bool:
        return self.stored[name].dtype != self.dtype


def held_fp32(weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """``name`` as held, in fp32: a parameter vLLM keeps in fp32 whatever the model's dtype (the
    confidence head, ``params_dtype=torch.float32``); a bf16 model holds fp32 weights rounded."""
    return (weights.stored if isinstance(weights, ComputeWeights) else weights)[name].float()


def embedding(weights: Mapping[str, torch.Tensor], name: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the table ``name`` in the compute dtype (only those rows converted)."""
    if isinstance(weights, ComputeWeights):
        return F.embedding(ids, weights.stored[name]).to(weights.dtype)
    return F.embedding(ids, weights[name])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / sqrt(mean(x^2) + eps)`` in fp32 (or wider), returned in x's dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def fp8_round_trip(
    x: torch.Tensor, fp8: torch.dtype, scale: float = 1.0, reciprocal: bool = False
) -> torch.Tensor:
    """x written to an fp8 KV cache and read back, in x's dtype, as vLLM 0.32.0 does: the write
    divides by the layer's scale in fp32 and stores it saturated to the format's finite range,
    rounded to nearest even (``triton_reshape_and_cache_flash.py``,
    ``reshape_and_cache_kernel_flash``: ``key / k_scale``, a saturating store), the read multiplies
    by the scale in fp32 and rounds to the compute dtype (``triton_decode_attention.py``:
    ``(k.to(float32) * ks).to(q.dtype)``).  Saturating first keeps torch's cast from giving NaN.
    ``reciprocal``: the write multiplies by the scale's fp32 reciprocal instead, as the K3 fused
    decode insert does (vllm/models/kimi_k3/nvidia/mla.py, ``_k_scale_inv``, ``_q_scale_inv``)."""
    limit = torch.finfo(fp8).max
    # a device tensor: torch's CUDA division by a CPU scalar would multiply by its reciprocal
    s = torch.tensor(scale, dtype=torch.float32, device=x.device)
    y = x.float() * s.reciprocal() if reciprocal else x.float() / s
    return (y.clamp_(-limit, limit).to(fp8).float() * s).to(x.dtype)


def swiglu(x: torch.Tensor, gate, up, down, linear=F.linear) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))``, each product ``linear(x, weight)``."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def inv_freq(d: int, base: float, yarn: Any = None) -> torch.Tensor:
    """RoPE's inverse frequencies of ``d`` rotary dims, fp32 [d/2]: ``base^(-2j/d)``; with
    ``yarn``, YaRN's ramp between the correction dims of beta_fast and beta_slow, as vLLM 0.32's
    ``YaRNScalingRotaryEmbedding._compute_inv_freq``
    (vllm/model_executor/layers/rotary_embedding/yarn_scaling_rope.py)."""
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    if yarn is None:
        return 1.0 / pos_freqs
    orig = yarn.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = float(max(math.floor(correction_dim(yarn.beta_fast)), 0))
    high = float(min(math.ceil(correction_dim(yarn.beta_slow)), d - 1))
    if low == high:
        high += 0.001  # DeepSeek's guard against a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (yarn.factor * pos_freqs)
    return interpolated * ramp + extrapolated * (1 - ramp)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, mscale: float):
    """Neox RoPE: rotate the halves of x [..., T, heads, d] by ``pos * inv_freq``, cos and sin
    scaled by YaRN's ``mscale``."""
    angle = pos.to(torch.float32)[..., None] * inv_freq  # [..., T, d/2]
    cos, sin = (angle.cos() * mscale)[..., None, :], (angle.sin() * mscale)[..., None, :]
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Draft:
    """A draft's forward in ``dtype`` on ``device``: ``weights`` (d2t/t2d left out) held once
    after ``check``, ``kv`` its KV cache, ``served`` its linears' inputs; ``setup`` the rest."""

    # On the CPU a bf16 model multiplies its operands upcast exactly to fp32 (``fp32_products``):
    # torch's CPU bf16 kernel is ~10x slower and differs only in the order of the fp32 sums
    upcast_on_cpu = True

    def __init__(
        self,
        config: Any,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv: KVCache = KV_CACHES["auto"],
        served: ServedLinears | None = None,
    ):
        self.check(config, {k: tuple(v.shape) for k, v in weights.items()})
        self.config, self.dtype, self.kv = config, dtype, kv
        if self.upcast_on_cpu:
            upcast = dtype != torch.float32 and torch.device(device).type == "cpu"
            served = replace(served or ServedLinears(), fp32_products=upcast)
        floats = {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}
        self.w = ComputeWeights(floats, dtype, device, served)
        self.device = self.w.device
        self.setup(weights)

    def check(self, config: Any, shapes: Mapping[str, tuple[int, ...]]) -> None: ...

    def setup(self, weights: Mapping[str, torch.Tensor]) -> None: ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return embedding(self.w, EMBED, tokens)


class DenseDraft(Draft):
    """The Qwen3-style DSpark's (vLLM 0.32.0's qwen3_dflash.py) and EAGLE-3's (llama_eagle3.py)
    layers: biased projections, GQA attention with RoPE and an fp8 KV cache, the SwiGLU MLP."""

    qk_norm = True  # q and k RMS-normed per head (Qwen3)
    check_tensors: Callable[[Any, Mapping[str, tuple[int, ...]], str], None]

    def check(self, config: Any, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.check_tensors(config, shapes, "weights")
        for name in (EMBED, LM_HEAD):
            if name not in shapes:
                raise ValueError(
                    f"weights: {name} is required (the target's, when not the draft's)"
                )

    def setup(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.kv_fp8 = getattr(torch, str(self.kv.dtype)) if self.kv.quantized else None
        rope, d = self.config.rope_parameters, self.config.head_dim
        if rope.rope_type == "llama3":
            self.inv_freq = rope.inv_freq(d).to(self.device)
        else:
            yarn = rope if rope.rope_type == "yarn" else None
            self.inv_freq = inv_freq(d, float(rope.rope_theta), yarn).to(self.device)
        self.mscale = rope.mscale

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm(x, self.w[f"{name}.weight"], self.config.rms_norm_eps)

    def proj(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T (+ b)``, the bias added in fp32 before rounding (as a GEMM epilogue adds it)."""
        bias = self.w.stored.get(f"{name}.bias")
        if bias is None:
            return self.w.linear(f"{name}.weight", x)
        return (self.w.linear(f"{name}.weight", x, torch.float32) + bias.float()).to(self.dtype)

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i's SwiGLU MLP of x, post_attention_layernorm'ed."""
        h, p = self.norm(x, f"layers.{i}.post_attention_layernorm"), f"layers.{i}.mlp."
        return swiglu(h, p + "gate_proj", p + "up_proj", p + "down_proj", self._linear)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.w.linear(f"{name}.weight", x)

    def key_value(self, i: int, h: torch.Tensor, pos: torch.Tensor):
        """Layer i's keys (k_norm, RoPE) and values of h [..., T, H]: [..., T, kv, d] each, as
        every read of the KV cache sees them: an fp8 cache's are rounded (the context's by
        ``precompute_and_store_context_kv``, the block's own by the attention layer's cache
        update before it attends, ``unified_kv_cache_update``; docs/eval-drift.md, "KV cache"),
        each divided by its layer's scale (``do_kv_cache_update`` with ``_k_scale``, ``_v_scale``)."""
        c, a = self.config, f"layers.{i}.self_attn"
        k = self.proj(a + ".k_proj", h).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        v = self.proj(a + ".v_proj", h).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        if self.qk_norm:
            k = self.norm(k, a + ".k_norm")
        k = apply_rope(k, pos, self.inv_freq, self.mscale)
        served = self.w.served
        if served.observe_cache is not None:
            served.observe_cache(a, k, v)
        if self.kv_fp8 is None:
            return k, v
        k_scale, v_scale = served.cache_scales(a)
        return fp8_round_trip(k, self.kv_fp8, k_scale), fp8_round_trip(v, self.kv_fp8, v_scale)

    def query(self, i: int, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Layer i's queries (q_norm, RoPE) [..., T, n, d]."""
        c, a = self.config, f"layers.{i}.self_attn."
        q = self.proj(a + "q_proj", h).unflatten(-1, (c.num_attention_heads, c.head_dim))
        if self.qk_norm:
            q = self.norm(q, a + "q_norm")
        return apply_rope(q, pos, self.inv_freq, self.mscale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        """q [..., Tq, n, d] over k, v [..., Tk, kv, d] (GQA; ``mask`` [..., Tq, Tk] True where
        visible) -> [..., Tq, n*d]."""
        q = q.unflatten(-2, (self.config.num_key_value_heads, -1))  # [..., Tq, kv, g, d]
        s = torch.einsum("...qkgd,...tkd->...kgqt", q.float(), k.float())
        s = s * self.config.head_dim**-0.5
        if mask is not None:
            s = s.masked_fill(~mask[..., None, None, :, :], float("-inf"))
        p = torch.softmax(s, dim=-1).to(self.dtype)
        out = torch.einsum("...kgqt,...tkd->...qkgd", p.float(), v.float())  # upcasts: exact
        return out.to(self.dtype).flatten(-3)


class CausalRows(ABC):
    """A model's causal stream (interface.py's ``AuxChunks``): ``rows(t0, t1)`` -> [S, t1 - t0,
    depth*H] in ``dtype``, taken in order.  A subclass names its cache's per-position shapes
    (``cache_dims``; ``_cache`` holds one [S, T, ...] tensor of each per step) and ``compute``s."""

    def __init__(
        self, model: Any, ids: torch.Tensor, dtype: torch.dtype = torch.float32, depth=None
    ):
        c, (S, T) = model.config, ids.shape
        self.model, self.ids, self.dtype = model, ids, dtype
        self.layers = causal_layers(c.num_hidden_layers, depth)
        self.shape = (S, T, len(self.layers) * c.hidden_size)
        self._cache = [
            [
                torch.empty(S, T, *d, dtype=model.dtype, device=model.device)
                for d in self.cache_dims(c)
            ]
            for _ in self.layers
        ]
        self._next = 0

    def rows(self, t0: int, t1: int) -> torch.Tensor:
        if t0 != self._next or not t0 < t1 <= self.shape[1]:
            raise RuntimeError(f"causal rows must be taken in order: asked {t0}..{t1}")
        self._next = t1
        return self.compute(t0, t1)

    @abstractmethod
    def cache_dims(self, config: Any) -> tuple[tuple[int, ...], ...]:
        """The per-position shapes of one step's cache tensors."""

    @abstractmethod
    def compute(self, t0: int, t1: int) -> torch.Tensor:
        """Positions t0..t1-1 of every stream, each step's cache filled on the way."""
