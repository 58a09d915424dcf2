"""E2M1 code-level helpers for the format tests: the package's rounding and packing core
(``qstream.formats.e2m1``) exposed one step at a time, so that tests can hold it to the
threshold definition of docs/formats.md and to the nibble layout."""

from __future__ import annotations

import torch

from qstream.formats import e2m1


def _codes32(y: torch.Tensor) -> torch.Tensor:
    y = y.float()
    return e2m1._codes32(y.abs(), y, torch.empty(y.shape, dtype=torch.int32))


def _bytes(codes: torch.Tensor) -> torch.Tensor:
    out = torch.empty((*codes.shape[:-1], codes.shape[-1] // 2), dtype=torch.uint8)
    return e2m1._pack32(codes, out)


def round_to_codes(y: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to E2M1 codes (uint8, same shape): round half to even,
    saturating at +-6, sign bit from ``signbit(y)``.  NaN must be rejected beforehand."""
    return _codes32(y).to(torch.uint8)


def encode_packed(y: torch.Tensor) -> torch.Tensor:
    """Already-scaled float values ``[..., K]`` -> packed E2M1 bytes ``[..., K/2]``, through
    the fused path the quantizers use."""
    return _bytes(_codes32(y))


def pack(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes -> ``[..., K/2]`` bytes, element 2j in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of 4-bit codes: shape {tuple(codes.shape)}")
    return _bytes(codes.to(torch.int32))


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., K/2]`` bytes -> ``[..., K]`` codes."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes -> their values (exact in any float dtype)."""
    return e2m1._DECODE.to(device=codes.device, dtype=dtype)[codes.long()]
