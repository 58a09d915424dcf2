"""The three weight formats (docs/formats.md) as :class:`Format` objects, and the registry: the
only place a format's name maps to its object.

>>> stored = get_format("nvfp4").quantize(w)  # {"weight_packed": ..., "weight_scale": ..., ...}
"""

from __future__ import annotations

import torch

from qstream.errors import QStreamError
from qstream.formats.format import Format, Stored
from qstream.formats.fp8 import FP8
from qstream.formats.mxfp4 import MXFP4
from qstream.formats.nvfp4 import NVFP4
from qstream.formats.snr import Energy, snr_db, snr_sums, weight_snr_db

FORMATS: dict[str, Format] = {f.name: f for f in (FP8, MXFP4, NVFP4)}
# Every stored suffix but the plain ``weight``: a tensor so named is quantization data.
QUANTIZED_SUFFIXES = tuple(
    dict.fromkeys(s for f in FORMATS.values() for s in f.stored if s != "weight")
)
# Each format's codes suffix -> weight elements per stored element along K ("weight_packed": 2).
CODE_SUFFIXES = {f.stored[0]: f.codes_per_byte for f in FORMATS.values()}


def get_format(name: str) -> Format:
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
) -> Stored:
    return get_format(fmt).quantize(w, name, global_amax, energy)


def dequantize(fmt: str, stored: Stored, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return get_format(fmt).dequantize(stored, dtype)


__all__ = [
    "FORMATS",
    "CODE_SUFFIXES",
    "QUANTIZED_SUFFIXES",
    "Energy",
    "Format",
    "get_format",
    "quantize",
    "dequantize",
    "weight_snr_db",
    "snr_sums",
    "snr_db",
]
