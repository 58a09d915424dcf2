"""NVFP4: E2M1 elements in blocks of 16 along K, an FP8 E4M3 scale per block and one FP32
global scale per tensor, or per fused group (docs/formats.md; compressed-tensors'
``nvfp4-pack-quantized``, ``strategy: tensor_group``).

``gs = 448 * 6 / amax(|W|)`` in the weight dtype, stored float32 (1.0 when not finite, e.g. for
an all-zero tensor); ``s = fp8(clamp(gs * (amax_block / 6), +-448))`` with ``amax_block / 6`` in
the weight dtype, a zero ``s`` becoming 0.125; elements ``w / (s / gs)`` in float32 rounded to
E2M1."""

from __future__ import annotations

import torch

from qstream.formats.e2m1 import dequantize_blocks, encode_blocks, fp4_format
from qstream.formats.format import (
    FP4_MAX,
    FP8_MAX,
    NVFP4_BLOCK,
    NVFP4_ZERO_BLOCK_SCALE,
    abs_max,
    all_block_abs_max,
    check_finite,
    check_weight,
)
from qstream.formats.fp8 import _MAGNITUDE_BITS, decode_magnitudes
from qstream.formats.snr import Energy

# amax(|w|) in w.dtype: global_scale's input (a fused group's: the max over its members')
tensor_amax = abs_max


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """``[1]`` float32 global scale of a tensor (or group) amax in the weight dtype."""
    amax = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    # compressed-tensors writes ``448 * 6 / amax``, which torch evaluates as
    # ``amax.reciprocal() * 2688`` (Tensor.__rtruediv__): two roundings in the weight dtype.
    scale = amax.reciprocal() * (FP8_MAX * FP4_MAX)
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0).float().reshape(1)


def block_scale(block_amax: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """Block amax (weight dtype) and global scale -> float8_e4m3fn block scale; a zero scale
    becomes 0.125's code without a round trip through float (which costs more than the rest)."""
    local = block_amax / torch.tensor(FP4_MAX, dtype=block_amax.dtype)
    scale = (gs * local).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    zero = torch.bitwise_and(scale, _MAGNITUDE_BITS) == 0
    return scale.masked_fill_(zero, _ZERO_BLOCK_CODE).view(torch.float8_e4m3fn)


_ZERO_BLOCK_CODE = torch.tensor(NVFP4_ZERO_BLOCK_SCALE).to(torch.float8_e4m3fn).view(torch.uint8)


def quantize(
    w: torch.Tensor,
    name: str = "weight",
    global_amax: torch.Tensor | None = None,
    energy: Energy | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> ``(weight_packed uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16],
    weight_global_scale float32 [1])``.  ``global_amax`` (weight dtype, at least the tensor's
    own): a fused group's shared amax."""
    check_weight(w, name, NVFP4_BLOCK)
    n, k = w.shape
    block_amax = all_block_abs_max(w, NVFP4_BLOCK, name)  # [N, G]
    if global_amax is None:
        amax = block_amax.amax() if block_amax.numel() else torch.zeros((), dtype=w.dtype)
    else:
        amax = torch.as_tensor(global_amax, dtype=w.dtype)
    check_finite(amax, name)
    gs = global_scale(amax)
    scales = block_scale(block_amax, gs)  # [N, G] float8_e4m3fn
    # float32 as compressed-tensors divides; also dequantize's step (fp8 -> any dtype is exact)
    divisor = (decode_magnitudes(scales) / gs).unsqueeze(-1)  # [N, G, 1]; scales are > 0
    packed = torch.empty((n, k // 2), dtype=torch.uint8, device=w.device)
    encode_blocks(w, divisor, NVFP4_BLOCK, packed, energy)
    return packed, scales, gs


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``E2M1 * (weight_scale / weight_global_scale)`` in float32, rounded to ``dtype``, as
    compressed-tensors decompresses."""
    step = scale.to(dtype).float() / global_scale.float()  # [N, G]
    return dequantize_blocks(packed, step, NVFP4_BLOCK, dtype)


NVFP4 = fp4_format(
    "nvfp4",
    NVFP4_BLOCK,
    "tensor_group",
    "F8_E4M3",
    scale_type="E4M3 per block + FP32",
    scales_checked="block and global scales finite and positive",
    encode=quantize,
    decode=lambda stored, dtype: dequantize(
        stored["weight_packed"], stored["weight_scale"], stored["weight_global_scale"], dtype
    ),
    global_scale="weight_global_scale",
)
