"""The three weight formats as pure functions, and what each stores.

>>> stored = quantize("nvfp4", w)            # {"weight_packed": ..., "weight_scale": ..., ...}
>>> w_hat = dequantize("nvfp4", stored)      # bf16, bit-identical to compressed-tensors
>>> weight_snr_db(w, w_hat)

Per-format modules (:mod:`~qstream.formats.fp8`, :mod:`~qstream.formats.mxfp4`,
:mod:`~qstream.formats.nvfp4`) hold the math; this module is the table and the dispatch.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from qstream.errors import QStreamError
from qstream.formats import fp8, mxfp4, nvfp4
from qstream.formats.energy import Energy
from qstream.formats.spec import MXFP4_BLOCK, NVFP4_BLOCK


@dataclass(frozen=True)
class FormatSpec:
    name: str
    block_size: int  # elements along K sharing one scale (K itself for per-channel FP8)
    bits_per_weight: float  # element bits plus scale bits amortised over the block
    scale_type: str
    layout: str  # compressed-tensors format string (quantization_config.format)
    stored: tuple[str, ...]  # tensor-name suffixes written for each quantized module
    weights_args: dict  # quantization_config.config_groups.group_0.weights


FORMATS: dict[str, FormatSpec] = {
    "fp8": FormatSpec(
        "fp8",
        0,
        8.0,
        "weight dtype, per row",
        "naive-quantized",
        ("weight", "weight_scale"),
        {
            "num_bits": 8,
            "type": "float",
            "strategy": "channel",
            "symmetric": True,
            "dynamic": False,
        },
    ),
    "mxfp4": FormatSpec(
        "mxfp4",
        MXFP4_BLOCK,
        4 + 8 / MXFP4_BLOCK,
        "E8M0 per block",
        "mxfp4-pack-quantized",
        ("weight_packed", "weight_scale"),
        {
            "num_bits": 4,
            "type": "float",
            "strategy": "group",
            "group_size": MXFP4_BLOCK,
            "symmetric": True,
            "dynamic": False,
            "scale_dtype": "torch.uint8",
        },
    ),
    "nvfp4": FormatSpec(
        "nvfp4",
        NVFP4_BLOCK,
        4 + 8 / NVFP4_BLOCK,
        "E4M3 per block + FP32",
        "nvfp4-pack-quantized",
        ("weight_packed", "weight_scale", "weight_global_scale"),
        {
            "num_bits": 4,
            "type": "float",
            "strategy": "tensor_group",
            "group_size": NVFP4_BLOCK,
            "symmetric": True,
            "dynamic": False,
            "scale_dtype": "torch.float8_e4m3fn",
        },
    ),
}


def get_format(name: str) -> FormatSpec:
    try:
        return FORMATS[name]
    except KeyError:
        raise QStreamError(f"unknown format {name!r}; choose one of {', '.join(FORMATS)}") from None


def quantize(
    fmt: str,
    w: torch.Tensor,
    name: str = "weight",
    global_amax: torch.Tensor | None = None,
    energy: Energy | None = None,
) -> dict[str, torch.Tensor]:
    """Quantize one ``[N, K]`` weight; returns the stored tensors keyed by suffix
    (``FORMATS[fmt].stored``).  ``global_amax`` is NVFP4's shared fused-group amax.
    ``energy`` (an :class:`Energy`) accumulates the weight SNR sums on the way, equal to
    ``snr_sums(w, dequantize(fmt, stored, w.dtype))`` without that second pass.  A weight
    with no elements is a ValueError naming it (no scale can be taken of nothing; quantize
    refuses such a checkpoint before it gets here)."""
    spec = get_format(fmt)
    if w.numel() == 0:
        raise ValueError(f"{name}: shape {list(w.shape)} has no elements; nothing to quantize")
    out: tuple[torch.Tensor, ...]
    if fmt == "fp8":
        out = fp8.quantize(w, name, energy)
    elif fmt == "mxfp4":
        out = mxfp4.quantize(w, name, energy)
    else:
        out = nvfp4.quantize(w, name, global_amax, energy)
    return dict(zip(spec.stored, out))


def dequantize(fmt: str, stored: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16):
    """Stored tensors (as returned by :func:`quantize` or read from a checkpoint) -> weight.
    FP8 returns its scale's dtype; the 4-bit formats return ``dtype`` (bf16 by default), as
    compressed-tensors' decompression does."""
    get_format(fmt)
    if fmt == "fp8":
        return fp8.dequantize(stored["weight"], stored["weight_scale"])
    if fmt == "mxfp4":
        return mxfp4.dequantize(stored["weight_packed"], stored["weight_scale"], dtype)
    return nvfp4.dequantize(
        stored["weight_packed"], stored["weight_scale"], stored["weight_global_scale"], dtype
    )


# snr_sums works through a tensor in float64 slices of this many elements, in a buffer kept per
# thread: fresh float64 temporaries for every piece of a checkpoint cost ten times the
# quantization itself in page faults.
SNR_SLICE = 1 << 20
_snr_scratch = threading.local()


def _float64_scratch(n: int, device: torch.device) -> torch.Tensor:
    buf = getattr(_snr_scratch, "buf", None)
    if buf is None or buf.numel() < n or buf.device != device:
        buf = _snr_scratch.buf = torch.empty(n, dtype=torch.float64, device=device)
    return buf[:n]


def snr_sums(w: torch.Tensor, w_hat: torch.Tensor) -> tuple[float, float]:
    """``(sum w^2, sum (w - w_hat)^2)`` in float64 (exact differences, float64 squares and
    sums), for accumulating a weight's SNR over pieces."""
    flat, flat_hat = w.reshape(-1), w_hat.reshape(-1)
    signal = noise = 0.0
    for start in range(0, flat.numel(), SNR_SLICE):
        part = flat[start : start + SNR_SLICE]
        x = _float64_scratch(part.numel(), w.device).copy_(part)
        signal += torch.dot(x, x).item()
        x.sub_(flat_hat[start : start + SNR_SLICE])
        noise += torch.dot(x, x).item()
    return signal, noise


def snr_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)``; inf when the error is zero, -inf for a zero signal."""
    if noise == 0.0:
        return float("inf")
    if signal == 0.0:
        return float("-inf")
    return 10.0 * math.log10(signal / noise)


def weight_snr_db(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """docs/formats.md: ``10 log10(sum w^2 / sum (w - w_hat)^2)``, accumulated in float64."""
    return snr_db(*snr_sums(w, w_hat))


__all__ = [
    "FORMATS",
    "Energy",
    "FormatSpec",
    "get_format",
    "quantize",
    "dequantize",
    "weight_snr_db",
    "snr_sums",
    "snr_db",
]
