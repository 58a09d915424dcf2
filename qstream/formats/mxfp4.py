"""MXFP4: E2M1 elements in blocks of 32 along K with a shared E8M0 (power-of-two) scale
(OCP MX v1.0 element and scale types; docs/formats.md; compressed-tensors'
``mxfp4-pack-quantized``).

Scale rule ("even" rounding of the block amax, as vLLM's MXFP4 checkpoints use): round the amax
to one mantissa bit (so ``amax >= 1.75 * 2**e`` moves up to ``2**(e+1)``), then
``e8m0 = 127 + floor(log2(that)) - 2`` clamped to 0..255; a zero block gets 0."""

from __future__ import annotations

import torch

from qstream.formats.e2m1 import dequantize_blocks, encode_blocks, fp4_format
from qstream.formats.format import (
    MXFP4_BLOCK,
    MXFP4_E8M0_BIAS,
    MXFP4_ELEM_EMAX,
    all_block_abs_max,
    check_weight,
)
from qstream.formats.snr import Energy

_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def _round_mantissa_to_one_bit(amax: torch.Tensor) -> torch.Tensor:
    """A non-negative float rounded to a power of two, up when its mantissa is >= 0.75 of the
    binade (to E2M1's mantissa width, then dropped), with integer bit operations."""
    mantissa_bits = _MANTISSA_BITS[amax.dtype]
    bits = amax.view(_INT_VIEW[amax.dtype]).to(torch.int32)
    bits = (bits + (1 << (mantissa_bits - 2))) & ~((1 << mantissa_bits) - 1)
    return bits.to(_INT_VIEW[amax.dtype]).view(amax.dtype)


def _exponent(x: torch.Tensor) -> torch.Tensor:
    """``floor(log2(x))`` of a positive power of two, exactly, from float64 bits (every float32
    power of two, subnormal 2**-127 included, is normal in float64).  Zero gives -1023."""
    return (x.double().view(torch.int64) >> 52) - 1023


def _power_of_two(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2**exponent`` built from float64 bits (exact), then rounded to ``dtype``."""
    return ((exponent.long() + 1023) << 52).view(torch.float64).to(dtype)


def block_scale(amax: torch.Tensor) -> torch.Tensor:
    """Block amax (weight dtype) -> ``2**(e8m0 - 127)`` in that dtype; one that underflows it
    (fp16) becomes 1.0, as in compressed-tensors."""
    e8m0 = MXFP4_E8M0_BIAS - MXFP4_ELEM_EMAX + _exponent(_round_mantissa_to_one_bit(amax))
    scale = _power_of_two(e8m0.clamp_(0, 255) - MXFP4_E8M0_BIAS, amax.dtype)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def decode_scale(e8m0: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _power_of_two(e8m0.long() - MXFP4_E8M0_BIAS, dtype)


def quantize(
    w: torch.Tensor, name: str = "weight", energy: Energy | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> ``(weight_packed uint8 [N, K/2], weight_scale uint8 [N, K/32])``."""
    check_weight(w, name, MXFP4_BLOCK)
    n, k = w.shape
    scale = block_scale(all_block_abs_max(w, MXFP4_BLOCK, name))  # [N, G] in w.dtype
    stored_scale = (MXFP4_E8M0_BIAS + _exponent(scale)).to(torch.uint8)  # E8M0
    # Division by a power of two is exact, so x * (1/scale) in float32 classifies every
    # element exactly as compressed-tensors' division in the weight dtype does.
    inverse = torch.reciprocal(scale.float()).unsqueeze(-1)  # [N, G, 1]
    # dequantize's scale: the stored byte decoded in w.dtype (differs from ``scale`` only where
    # that overflowed the dtype, e.g. an fp16 block near 65504)
    step = decode_scale(stored_scale, w.dtype).float().unsqueeze(-1)
    packed = torch.empty((n, k // 2), dtype=torch.uint8, device=w.device)
    # A bf16 w's w_hat needs no rounding: E2M1 values have two significant bits, and times a
    # power of two >= 2**-127 they stay bf16 values (bf16 has float32's exponent range and
    # its subnormals reach 2**-133), or are inf or NaN as in bf16.
    exact = w.dtype == torch.bfloat16
    encode_blocks(w, step, MXFP4_BLOCK, packed, energy, inverse=inverse, step=step, exact=exact)
    return packed, stored_scale


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
    """``E2M1 * 2**(e8m0 - 127)`` in ``dtype``, as compressed-tensors returns."""
    return dequantize_blocks(packed, decode_scale(scale, dtype), MXFP4_BLOCK, dtype, dtype)


MXFP4 = fp4_format(
    "mxfp4",
    MXFP4_BLOCK,
    "group",
    "U8",
    scale_type="E8M0 per block",
    scales_checked="no E8M0 scale 0xFF (NaN)",
    encode=lambda w, name, global_amax, energy: quantize(w, name, energy),
    decode=lambda stored, dtype: dequantize(stored["weight_packed"], stored["weight_scale"], dtype),
    bad_scales=lambda value: (value, value == 0xFF, "E8M0 0xFF (NaN)"),  # NaN in OCP MX
)
