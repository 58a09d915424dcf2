"""FP8 E4M3, one scale per output channel (DESIGN.md section 3; compressed-tensors'
``naive-quantized`` format with ``strategy: channel``).

``scale = amax(|w[n, :]|) / 448`` and ``q = fp8(clamp(w / scale, +-448))``, both evaluated in the
weight's own dtype, exactly as compressed-tensors does for a bf16/fp16/fp32 weight."""

from __future__ import annotations

import torch

from qstream.formats.checks import block_abs_max, check_finite, check_weight, row_chunks
from qstream.formats.energy import Energy
from qstream.formats.spec import FP8_MAX


def channel_scale(w: torch.Tensor) -> torch.Tensor:
    """``[N, 1]`` scale in ``w.dtype``; an all-zero row gets that dtype's eps.  The row amax
    is taken on the integer view (exact, see block_abs_max)."""
    amax = block_abs_max(w, w.shape[1])
    scale = amax / torch.tensor(FP8_MAX, dtype=w.dtype)
    return torch.where(scale == 0, torch.finfo(w.dtype).eps, scale)


def quantize(w: torch.Tensor, name: str = "weight", energy: Energy | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> ``(weight float8_e4m3fn [N, K], weight_scale w.dtype [N, 1])``;
    ``energy`` accumulates the weight SNR sums against :func:`dequantize`'s ``q * scale``,
    taken chunk by chunk while the chunk is in cache."""
    check_weight(w, name)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((w.shape[0], 1), dtype=w.dtype, device=w.device)
    for rows in row_chunks(*w.shape):
        chunk = w[rows]
        scale[rows] = s = channel_scale(chunk)
        check_finite(s, name)
        y = (chunk / s).clamp_(-FP8_MAX, FP8_MAX)
        q[rows] = y.to(torch.float8_e4m3fn)
        if energy is not None:
            energy.add(chunk, (round_to_fp8(y.float()) * s.float()).to(w.dtype))
    return q, scale


_EXPONENT_MASK = 0x7F800000
_MIN_NORMAL_BITS = (127 - 6) << 23  # 2**-6, float8_e4m3fn's smallest normal


def round_to_fp8(y: torch.Tensor) -> torch.Tensor:
    """float32 ``y`` (within +-448, consumed) rounded to float8_e4m3fn's grid, kept in float32:
    the value ``y.to(float8_e4m3fn).float()`` has, without torch's float8 -> float conversion,
    which is ~20x slower than this.  ``(a + M) - M`` with ``M = 2**(20 + e)``,
    ``e = max(floor(log2 |y|), -6)``: M's ulp is the E4M3 step of y's binade (2**-9 below
    2**-6), so float32's round-to-nearest-even rounds once, onto that grid."""
    a = y.abs()
    magic = a.view(torch.int32).bitwise_and(_EXPONENT_MASK).clamp_(min=_MIN_NORMAL_BITS)
    magic = magic.add_(20 << 23).view(torch.float32)
    return a.add_(magic).sub_(magic).copysign_(y)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Back to the scale's dtype: ``q * scale`` (compressed-tensors' decompression).  The
    quantizer's SNR uses ``round_to_fp8(y) * scale`` in float32, rounded once to the dtype:
    the same value, since a 4-bit by 11-bit product is exact in float32."""
    return q.to(scale.dtype) * scale
