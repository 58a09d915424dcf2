"""What every draft architecture's forward computes the same way (docs/model.md, "API",
"Memory"): its weights held once and read in its compute dtype, RMSNorm in fp32, the SwiGLU
MLP, RoPE's (YaRN) inverse frequencies, and the bookkeeping of a causal stream.

:class:`ComputeWeights` keeps a big weight that upcasts exactly (a bf16 checkpoint read by the
fp32 reference) in its stored dtype, a view of the mapped file shared with every variant that
leaves it unquantized, and upcasts it per use into one reused buffer; since the upcast is exact,
every product is bit-identical to holding the weight in fp32 (tests/test_device.py).  Small
tensors (norms, the confidence head) are upcast once and held.

>>> w = ComputeWeights(weights, torch.float32)        # bf16 in, fp32 out, each weight held once
>>> w.linear("lm_head.weight", hf)                     # hf @ lm_head^T, upcast in row chunks
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from qstream.arch.interface import causal_layers

# A weight whose compute-dtype copy has at most this many elements is converted once and held
# (64 MiB in fp32); a bigger one that upcasts exactly is held in its stored dtype.
HOLD_ELEMENTS = 1 << 24
# A weight upcast per use is converted and multiplied in row chunks of this many elements (32 MiB
# in fp32), but at least UPCAST_MIN_ROWS rows: a chunk is still in the last-level cache when the
# GEMM reads it, and no chunk is so thin that the GEMM loses speed (docs/eval-drift.md, "Memory").
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


def _stored(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """How one weight is held: as given when it is in ``dtype`` or upcasts exactly to it and is
    big; otherwise converted once (a downcast, e.g. fp32 -> bf16, is held rounded)."""
    tensor = tensor.detach()
    keep = tensor.dtype == dtype or (
        (tensor.dtype, dtype) in EXACT_UPCASTS and tensor.numel() > HOLD_ELEMENTS
    )
    return tensor.to(device=device, dtype=None if keep else dtype).contiguous()


class ComputeWeights(Mapping[str, torch.Tensor]):
    """name -> weight in ``dtype`` on ``device``; each weight is held once (module docstring).
    Reading a big bf16 weight of an fp32 model returns an fp32 temporary."""

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.dtype, self.device = dtype, torch.device(device)
        self.stored = {k: _stored(v, dtype, self.device) for k, v in weights.items()}
        self._buffer: torch.Tensor | None = None  # linear's upcast chunks, reused

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.stored[name].to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.stored)

    def __len__(self) -> int:
        return len(self.stored)

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight^T`` ([..., in] -> [..., rows]).  A weight upcast per use is converted
        into one reused buffer a row chunk at a time (``UPCAST_CHUNK_ELEMENTS``), each chunk
        multiplied while it is in cache.  Each output column is the same fp32 dot product as
        with the weight held in fp32, whole; bit-identical at the shapes tests/test_device.py
        runs, but a BLAS may order the reduction by the output's shape, and at K3's shapes some
        chunked products differ from one whole-matrix GEMM in the last bit (docs/eval-drift.md,
        "Memory")."""
        if not self.upcast_per_use(name):
            return F.linear(x, self[name])
        weight = self.stored[name]
        n, k = weight.shape
        chunk = max(UPCAST_MIN_ROWS, UPCAST_CHUNK_ELEMENTS // k)
        if chunk >= n:
            return F.linear(x, self._upcast_buffer(n * k).view(n, k).copy_(weight))
        buffer = self._upcast_buffer(chunk * k)
        out = x.new_empty(*x.shape[:-1], n)
        for r0 in range(0, n, chunk):
            r1 = min(r0 + chunk, n)
            part = buffer[: (r1 - r0) * k].view(r1 - r0, k).copy_(weight[r0:r1])
            out[..., r0:r1] = F.linear(x, part)
        return out

    def borrow(self, name: str) -> torch.Tensor:
        """``name`` in the compute dtype without a fresh temporary: a held weight itself, else
        upcast into the buffer :meth:`linear` reuses, valid until the next ``linear`` or
        ``borrow`` (the Markov table, read at every step of a rollout)."""
        if not self.upcast_per_use(name):
            return self.stored[name]
        weight = self.stored[name]
        return self._upcast_buffer(weight.numel()).view(weight.shape).copy_(weight)

    def _upcast_buffer(self, elements: int) -> torch.Tensor:
        """The reused upcast target, grown to the largest request so far: a fresh temporary
        per use would cost page faults on hundreds of MiB each time."""
        if self._buffer is None or self._buffer.numel() < elements:
            self._buffer = None  # freed before its replacement is allocated
            self._buffer = torch.empty(elements, dtype=self.dtype, device=self.device)
        return self._buffer[:elements]

    def upcast_per_use(self, name: str) -> bool:
        """Whether reading ``name`` converts it (the weight is held in a narrower dtype)."""
        return self.stored[name].dtype != self.dtype


def held_fp32(weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """``name`` as held, converted to fp32 whatever the compute dtype: for a parameter the
    deployment keeps in fp32 whatever the model's dtype (the confidence head: vLLM builds it
    with ``params_dtype=torch.float32`` and loads the checkpoint's value into it).  From a
    bf16 checkpoint that is the stored value exactly; fp32 weights given to a bf16 model are
    held rounded to bf16, as a bf16 checkpoint of them would store them."""
    if isinstance(weights, ComputeWeights):
        return weights.stored[name].float()
    return weights[name].float()


def embedding(weights: Mapping[str, torch.Tensor], name: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the table ``name`` in the compute dtype; of a :class:`ComputeWeights`
    only the rows looked up are converted (an embedding table is never upcast whole)."""
    if isinstance(weights, ComputeWeights):
        return F.embedding(ids, weights.stored[name]).to(weights.dtype)
    return F.embedding(ids, weights[name])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * x / sqrt(mean(x^2) + eps)`` in fp32 (or wider), returned in x's dtype."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def swiglu(x: torch.Tensor, gate, up, down, linear=F.linear) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))``, each product ``linear(x, weight)`` (by default the
    weights are tensors; the forwards pass weight names and their own products)."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def inv_freq(d: int, base: float, yarn: Any = None) -> torch.Tensor:
    """RoPE's inverse frequencies of ``d`` rotary dims, fp32 [d/2]: ``base^(-2j/d)``.  With
    ``yarn`` (its factor, original_max_position_embeddings, beta_fast and beta_slow), YaRN's:
    interpolated (``/factor``) below a linear ramp between the correction dims of beta_fast
    (floored) and beta_slow (ceiled), extrapolated above it, as DeepSeek-V3 and vLLM 0.32's
    ``YaRNScalingRotaryEmbedding._compute_inv_freq`` compute them
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


class CausalRows:
    """A model's causal stream (interface.py's ``AuxChunks``): every step's output of the
    causal pass over ids [S, T] (``depth`` steps in :func:`causal_layers`' order) as
    ``rows(t0, t1)`` -> [S, t1 - t0, depth*H] in ``dtype``, taken in order from position 0.  A
    subclass names its cache's per-position shapes (:meth:`cache_dims`; ``_cache`` holds one
    [S, T, ...] tensor of each per step) and computes the rows (:meth:`compute`)."""

    def __init__(
        self, model: Any, ids: torch.Tensor, dtype: torch.dtype = torch.float32, depth=None
    ):
        c = model.config
        S, T = ids.shape
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

    def cache_dims(self, config: Any) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    def compute(self, t0: int, t1: int) -> torch.Tensor:
        raise NotImplementedError
