"""compressed-tensors' own quantization path, used as the reference the format tests compare
against byte for byte.

It mirrors what llm-compressor does around compressed-tensors for a weight-only scheme: an
observer takes min/max over the strategy's reduction (per row, per group, per tensor), the
library's ``generate_gparam`` / ``calculate_qparams`` turn them into scales (the scale parameter
lives in the weight dtype, as ``initialize_qparams`` creates it), fused members share the
smallest global scale (llm-compressor's ``update_fused_layer_weight_global_scales``), and the
library's compressor writes the stored tensors.  Only the min/max reduction is ours."""

from __future__ import annotations

import torch
from compressed_tensors.compressors import (
    MXFP4PackedCompressor,
    NaiveQuantizationCompressor,
    NVFP4PackedCompressor,
)
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

FP8_CHANNEL = QuantizationScheme(
    targets=["Linear"],
    weights=QuantizationArgs(
        num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False
    ),
)
SCHEMES = {
    "fp8": FP8_CHANNEL,
    "mxfp4": preset_name_to_scheme("MXFP4A16", ["Linear"]),
    "nvfp4": preset_name_to_scheme("NVFP4A16", ["Linear"]),
}
COMPRESSORS = {
    "fp8": NaiveQuantizationCompressor,
    "mxfp4": MXFP4PackedCompressor,
    "nvfp4": NVFP4PackedCompressor,
}


def _observe(w: torch.Tensor, args: QuantizationArgs):
    if args.strategy == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    groups = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size))
    return groups.amin(dim=-1), groups.amax(dim=-1)


def ct_global_scale(w: torch.Tensor) -> torch.Tensor:
    return generate_gparam(w.amin(), w.amax())


def ct_quantize(fmt: str, w: torch.Tensor, fused_with: list[torch.Tensor] = ()) -> dict:
    """Stored tensors for ``w`` as compressed-tensors produces them.  ``fused_with`` are the
    other members of w's fused group (NVFP4: the group shares the smallest global scale)."""
    scheme = SCHEMES[fmt]
    args = scheme.weights
    state = {"weight": w}
    global_scale = None
    if fmt == "nvfp4":
        global_scale = torch.min(torch.cat([ct_global_scale(t) for t in (w, *fused_with)]))
        global_scale = global_scale.reshape(1)
        state["weight_global_scale"] = global_scale
    lo, hi = _observe(w, args)
    scale, zero_point = calculate_qparams(lo, hi, args, global_scale=global_scale)
    state["weight_scale"] = scale.to(w.dtype)  # the parameter has the observed dtype
    state["weight_zero_point"] = zero_point
    return COMPRESSORS[fmt].compress(state, scheme)


def ct_dequantize(fmt: str, stored: dict) -> torch.Tensor:
    return COMPRESSORS[fmt].decompress(dict(stored), SCHEMES[fmt])["weight"]
