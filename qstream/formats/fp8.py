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
        q[rows] = (chunk / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        if energy is not None:
            energy.add(chunk, dequantize(q[rows], s))
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Back to the scale's dtype: ``q * scale`` (compressed-tensors' decompression)."""
    return q.to(scale.dtype) * scale
