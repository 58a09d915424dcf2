"""The E2M1 (FP4) core shared by MXFP4 and NVFP4: rounding to 4-bit codes, nibble packing,
and decoding.  A code is ``sign << 3 | index`` with ``index`` into ``E2M1_GRID``; element 2j
of a row goes in the low nibble of byte j, element 2j+1 in the high nibble."""

from __future__ import annotations

import torch

from qstream.formats.spec import E2M1_GRID, E2M1_STEPS

# code -> value, including -0.0 for code 8 so that decoding keeps the sign bit
_DECODE = torch.tensor([*E2M1_GRID, *(-v for v in E2M1_GRID)], dtype=torch.float32)
_DECODE[8] = -0.0


def round_to_codes(y: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to E2M1 codes (uint8, same shape).

    Round-half-to-even with saturation at +-6: the index is the number of decision points that
    ``|y|`` passes, counted with integer adds on byte masks (no bucketing, no float rounding).
    The sign bit is ``signbit(y)``, so ``-0`` and small negatives that round to zero keep it, as
    compressed-tensors' packer does.  NaN is the caller's job to reject beforehand.
    """
    a = y.abs()
    index = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for threshold, inclusive in E2M1_STEPS:
        index += (a >= threshold) if inclusive else (a > threshold)
    return index | (torch.signbit(y).to(torch.uint8) << 3)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes -> ``[..., K/2]`` bytes, element 2j in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of 4-bit codes: shape {tuple(codes.shape)}")
    # Little-endian int16 view: byte 2j is the low byte, 2j+1 the high byte of one word.
    words = codes.contiguous().view(torch.int16)
    return ((words & 0x0F) | ((words >> 4) & 0xF0)).to(torch.uint8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., K/2]`` bytes -> ``[..., K]`` codes."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes -> their values (exact in any float dtype)."""
    return _DECODE.to(device=codes.device, dtype=dtype)[codes.long()]
