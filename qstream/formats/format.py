"""What every weight format is: a :class:`Format` object holding its facts (block, bits,
compressed-tensors config pieces, stored tensor names, dtypes and shapes, the scale checks
verify runs) and its two operations, quantize and dequantize (docs/formats.md).

Each format module (:mod:`~qstream.formats.fp8`, :mod:`~qstream.formats.mxfp4`,
:mod:`~qstream.formats.nvfp4`) defines one; :mod:`qstream.formats` is the registry that maps a
name to it.  Code outside ``formats/`` asks the object, never compares the name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from qstream.formats.snr import Energy
from qstream.units import FLOAT_DTYPE_NAMES

Stored = dict[str, torch.Tensor]  # stored tensors of one weight, by suffix ("weight_scale", ...)
# (w, name, global_amax, energy) -> the stored tensors, in ``Format.stored`` order
Encode = Callable[[torch.Tensor, str, torch.Tensor | None, Energy | None], tuple]
Decode = Callable[[Stored, torch.dtype], torch.Tensor]  # (stored, dtype) -> weight
BadScales = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, str]]


def finite_positive(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The usual scale check: finite and positive (quantize never writes a zero scale)."""
    value = value.float()
    return value, ~(torch.isfinite(value) & (value > 0)), "non-finite or not positive"


@dataclass(frozen=True)
class Format:
    name: str
    block_size: int  # elements along K sharing one scale (0: one scale per row)
    bits_per_weight: float  # element bits plus scale bits amortised over the block
    scale_type: str
    layout: str  # compressed-tensors format string (quantization_config.format)
    weights_args: dict  # quantization_config.config_groups.group_0.weights
    # Stored tensor suffix -> its safetensors dtype (None: the weight's own float dtype), in
    # the order written: the codes, then the scales.
    stored_dtypes: dict[str, str | None]
    codes_per_byte: int  # elements in one byte of the codes
    scales_checked: str  # what verify's scale check requires of this format's scales
    encode: Encode
    decode: Decode
    bad_scales: BadScales = finite_positive  # (values as reported, mask of bad ones, why)
    # The per-tensor scale that a fused group's members share (vLLM keeps one per fused
    # layer, docs/vllm.md), written once per tensor; None when the format has none.
    global_scale: str | None = None

    @property
    def stored(self) -> tuple[str, ...]:
        """Tensor-name suffixes written for each quantized module, in order."""
        return tuple(self.stored_dtypes)

    @property
    def scales(self) -> tuple[str, ...]:
        return self.stored[1:]

    def quantize(
        self,
        w: torch.Tensor,
        name: str = "weight",
        global_amax: torch.Tensor | None = None,
        energy: Energy | None = None,
    ) -> Stored:
        """Quantize one ``[N, K]`` weight; returns the stored tensors keyed by suffix.
        ``global_amax`` is a fused group's shared amax (for a format with a ``global_scale``).
        ``energy`` accumulates the weight SNR sums on the way, equal to
        ``snr_sums(w, self.dequantize(stored, w.dtype))`` without that second pass.  A weight
        with no elements is a ValueError naming it (no scale can be taken of nothing; quantize
        refuses such a checkpoint before it gets here)."""
        if w.numel() == 0:
            raise ValueError(f"{name}: shape {list(w.shape)} has no elements; nothing to quantize")
        return dict(zip(self.stored, self.encode(w, name, global_amax, energy)))

    def dequantize(self, stored: Stored, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Stored tensors (from :meth:`quantize` or a checkpoint) -> the weight.  FP8 returns
        its scale's dtype; the 4-bit formats return ``dtype``, as compressed-tensors does."""
        return self.decode(stored, dtype)

    def stored_shapes(self, n: int, k: int) -> dict[str, tuple[int, ...]]:
        """The shape of each stored tensor of an ``[n, k]`` weight, by suffix: the codes
        ``[N, K / codes_per_byte]``, one scale per block ``[N, K / block]`` (per row: ``[N, 1]``),
        the global scale ``[1]``."""
        codes, scale = self.stored[:2]
        per_row = k // self.block_size if self.block_size else 1
        shapes: dict[str, tuple[int, ...]] = {
            codes: (n, k // self.codes_per_byte),
            scale: (n, per_row),
        }
        if self.global_scale:
            shapes[self.global_scale] = (1,)
        return shapes

    def accepted_dtypes(self, suffix: str) -> tuple[str, ...]:
        """The safetensors dtype(s) a stored tensor may have."""
        dtype = self.stored_dtypes[suffix]
        return FLOAT_DTYPE_NAMES if dtype is None else (dtype,)

    def marks_quantized(self, suffix: str, dtype: str) -> bool:
        """Whether a stored tensor shows its module is quantized: the codes, or, where they
        keep the plain name ``weight``, only in their stored dtype."""
        codes = self.stored[0]
        return suffix == codes and (codes != "weight" or dtype in self.accepted_dtypes(codes))
