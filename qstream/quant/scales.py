"""The calibrated scales a static serving scheme stores beside the weights (docs/quantize.md,
"Activation and KV-cache schemes"): a quantized linear's ``input_scale`` (FP8 static, per
tensor) or ``input_global_scale`` (NVFP4 W4A4), and an attention layer's ``k_scale`` /
``v_scale`` (FP8 KV cache), each from the amax that calibration measured.

The formulas and dtypes are compressed-tensors' (checked bit for bit in
tests/test_quantize_schemes.py): ``calculate_qparams`` (symmetric float: ``amax / 448`` in the
observed dtype, a zero scale becoming that dtype's eps) and ``generate_gparam`` (``448 * 6 /
amax``, stored float32), on the min/max an observer of a bf16 model's activations holds, which
are in the weight dtype (``initialize_qparams``: the scale parameter takes the weight's dtype,
the global scale float32; both shape [1]).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from qstream.errors import QStreamError
from qstream.formats.format import FP8_MAX
from qstream.formats.nvfp4 import global_scale
from qstream.serving import Activations

# The stored input scale of a static scheme, by its compressed-tensors strategy.
INPUT_SCALE = {"tensor": "input_scale", "tensor_group": "input_global_scale"}
KV_SCALES = ("k_scale", "v_scale")  # on the attention module, as compressed-tensors names them
# What a calibration source needs to supply before quantize can write a static scheme.
NEEDS_CALIBRATION = "needs calibration (not available yet)"


@dataclass(frozen=True)
class Calibration:
    """The amaxes a static scheme's scales come from, and where they were measured (recorded
    in qstream_quantize.json).  This is the adapter a calibration run feeds."""

    source: str  # what the inputs were, e.g. the regime ("gauss") and the draft's inputs
    size: int  # how many calibration inputs (tokens) the amaxes were taken over
    inputs: Mapping[str, float] = field(default_factory=dict)  # linear -> amax of its input
    # attention module -> (amax of K, amax of V) as its cache stores them
    kv: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def record(self) -> dict:
        return {"source": self.source, "size": self.size}


def input_scale_name(activations: Activations) -> str | None:
    """The tensor a static scheme stores per quantized linear (None: dynamic, or none)."""
    return None if activations.dynamic else INPUT_SCALE[str(activations.strategy)]


def input_scale(activations: Activations, amax: float, dtype: torch.dtype) -> torch.Tensor:
    """``[1]`` stored input scale of a linear whose input amax is ``amax`` in a ``dtype``
    checkpoint: FP8 static ``input_scale`` in ``dtype``, NVFP4 ``input_global_scale`` float32."""
    observed = torch.tensor([amax], dtype=torch.float32).to(dtype)
    if input_scale_name(activations) == "input_global_scale":
        return global_scale(observed)
    return fp8_tensor_scale(observed)


def fp8_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' per-tensor FP8 scale of an amax in the observed dtype."""
    scale = amax / torch.tensor(FP8_MAX, dtype=amax.dtype)
    return torch.where(scale == 0, torch.finfo(amax.dtype).eps, scale)


def kv_scales(amax: tuple[float, float], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``k_scale`` and ``v_scale`` ([1], ``dtype``) of one attention layer's K and V amax."""
    return {
        name: fp8_tensor_scale(torch.tensor([a], dtype=torch.float32).to(dtype))
        for name, a in zip(KV_SCALES, amax)
    }


def checked_amax(what: str, module: str, amax: object) -> float:
    """``amax`` as a float, or QStreamError naming the module unless finite and positive."""
    if isinstance(amax, bool) or not isinstance(amax, (int, float)):
        raise QStreamError(f"{module}: calibrated {what} amax {amax!r} is not a number")
    value = float(amax)
    if not (value > 0 and value != float("inf")):
        raise QStreamError(f"{module}: calibrated {what} amax {value!r} must be finite and > 0")
    return value
