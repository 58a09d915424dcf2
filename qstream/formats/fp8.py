"""FP8 E4M3, one scale per output channel (docs/formats.md; compressed-tensors'
``naive-quantized`` format with ``strategy: channel``).

``scale = amax(|w[n, :]|) / 448`` and ``q = fp8(clamp(w / scale, +-448))``, both evaluated in the
weight's own dtype, exactly as compressed-tensors does for a bf16/fp16/fp32 weight."""

from __future__ import annotations

import torch

from qstream.formats.checks import (
    ChunkWorkspace,
    block_abs_max,
    check_finite,
    check_weight,
    chunk_rows,
    row_chunks,
)
from qstream.formats.energy import SHORT, Energy
from qstream.formats.spec import FP8_MAX


def channel_scale(w: torch.Tensor) -> torch.Tensor:
    """``[N, 1]`` scale in ``w.dtype``; an all-zero row gets that dtype's eps.  The row amax
    is taken on the integer view (exact, see block_abs_max)."""
    amax = block_abs_max(w, w.shape[1])
    scale = amax / torch.tensor(FP8_MAX, dtype=w.dtype)
    return torch.where(scale == 0, torch.finfo(w.dtype).eps, scale)


def quantize(
    w: torch.Tensor, name: str = "weight", energy: Energy | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> ``(weight float8_e4m3fn [N, K], weight_scale w.dtype [N, 1])``;
    ``energy`` accumulates the weight SNR sums against :func:`dequantize`'s ``q * scale``,
    taken chunk by chunk while the chunk is in cache."""
    check_weight(w, name)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((w.shape[0], 1), dtype=w.dtype, device=w.device)
    work = (
        None
        if energy is None
        else ChunkWorkspace(chunk_rows(*w.shape), w.shape[1], w.device, w.dtype)
    )
    for rows in row_chunks(*w.shape):
        chunk = w[rows]
        scale[rows] = s = channel_scale(chunk)
        check_finite(s, name)
        y = (chunk / s).clamp_(-FP8_MAX, FP8_MAX)
        q[rows] = y.to(torch.float8_e4m3fn)
        if energy is not None and work is not None:
            _add_energy(energy, chunk, y, s, work, rows)
    return q, scale


def _add_energy(
    energy: Energy,
    chunk: torch.Tensor,
    y: torch.Tensor,
    s: torch.Tensor,
    work: ChunkWorkspace,
    rows: slice,
) -> None:
    """The SNR sums of one chunk in magnitudes (w_hat has w's sign or is 0):
    ``|w_hat| = dtype(round_to_fp8(|y|) * s)``, which is :func:`dequantize`'s value, since a
    4-bit by 11-bit product is exact in float32 and is then rounded once to the dtype."""
    x, magnitude, scratch = work.take(rows)
    grid, hat = work.take_hat(rows)
    w_hat = round_to_fp8(torch.abs(magnitude.copy_(y), out=magnitude), scratch).mul_(s.float())
    if chunk.dtype in SHORT:
        w_hat = grid.copy_(hat.copy_(w_hat))
        torch.abs(x.copy_(chunk), out=x)
        energy.add_exact(x, w_hat.sub_(x))
    else:  # float32: the difference itself needs float64
        energy.add(chunk.abs(), w_hat)


_EXPONENT_MASK = 0x7F800000
_MIN_NORMAL_BITS = (127 - 6) << 23  # 2**-6, float8_e4m3fn's smallest normal


def round_to_fp8(a: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """float32 magnitudes ``a`` (at most 448; consumed) rounded to float8_e4m3fn's grid, kept
    in float32: ``|y|.to(float8_e4m3fn).float()`` without torch's float8 -> float conversion,
    which is ~20x slower than this.  ``(a + M) - M`` with ``M = 2**(20 + e)``,
    ``e = max(floor(log2 a), -6)``: M's ulp is the E4M3 step of a's binade (2**-9 below
    2**-6), so float32's round-to-nearest-even rounds once, onto that grid.  ``scratch``:
    an optional int32 buffer shaped like ``a``."""
    if scratch is None:
        scratch = torch.empty(a.shape, dtype=torch.int32, device=a.device)
    magic = torch.bitwise_and(a.view(torch.int32), _EXPONENT_MASK, out=scratch)
    magic = magic.clamp_(min=_MIN_NORMAL_BITS).add_(20 << 23).view(torch.float32)
    return a.add_(magic).sub_(magic)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Back to the scale's dtype: ``q * scale`` (compressed-tensors' decompression).  The
    quantizer's SNR uses ``round_to_fp8(|y|) * scale`` in float32, rounded once to the dtype:
    the same magnitude, since a 4-bit by 11-bit product is exact in float32."""
    return q.to(scale.dtype) * scale
