"""Activation quantization as vLLM 0.32.0 serves it (docs/eval-drift.md, "Serving
configurations"): per compressed-tensors input scheme, a quantized linear's input ``x [..., K]``
-> what the quantized GEMM multiplies, dequantized in float32 (the GEMM is simulated with a
float32 accumulation; the kernels apply the scales after it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from qstream.formats.e2m1 import round_e2m1
from qstream.formats.format import FP4_MAX, FP8_MAX, NVFP4_BLOCK
from qstream.formats.fp8 import amax_scale
from qstream.formats.nvfp4 import global_scale

# vLLM's _FP8_MIN_SCALING_FACTOR (vllm/model_executor/layers/quantization/input_quant_fp8.py):
# a dynamic scale never goes below it, so an all-zero row divides by a finite number.
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
FP4_RECIPROCAL = 1 / FP4_MAX  # vLLM's FLOAT4_E2M1_MAX_RECIPROCAL, a Python float


def fp8_per_token(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``CompressedTensorsW8A8Fp8`` with dynamic per-token inputs, as ``QuantFP8.forward_native``
    computes (vllm/model_executor/layers/quantization/input_quant_fp8.py; the CUDA op
    ``scaled_fp8_quant(..., use_per_token_if_dynamic=True)`` in vllm/_custom_ops.py):
    ``scale = max(amax(|row|) / 448, 1/(448*512))`` in float32 per row.  ``scale`` is ignored
    (a dynamic scheme has none)."""
    codes, scale = fp8_per_token_codes(x)
    return codes * scale


def fp8_per_token_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp8_per_token`'s codes (float32) and per-row float32 scales [..., 1], apart."""
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = (amax / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return _fp8_codes(x, scale), scale


def fp8_per_tensor(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``CompressedTensorsW8A8Fp8`` with a static per-tensor ``input_scale`` (the same
    ``forward_native``, the scale given)."""
    assert scale is not None, "a static scheme needs its calibrated scale"
    scale = scale.to(torch.float32)
    return _fp8_codes(x, scale) * scale


def _fp8_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8(clamp(x * (1/scale), +-448))`` in float32 (round to nearest even)."""
    q = (x.to(torch.float32) * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn).to(torch.float32)


def nvfp4_input(x: torch.Tensor, gs: torch.Tensor | None) -> torch.Tensor:
    """``CompressedTensorsW4A4Fp4``'s input: ``scaled_fp4_quant(x, input_global_scale_inv)``
    (vllm/_custom_ops.py), whose reference is ``ref_nvfp4_quant``
    (vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py), followed here step
    for step: per 16-element block ``s = fp8(clamp(gs * (amax * (1/6)), +-448))``, elements
    ``E2M1(clamp(x * 1/(s * 1/gs), +-6))``, dequantized as ``E2M1 * (s / gs)``
    (``ref_nvfp4_quant_dequant``, kept in float32).  ``gs`` is the checkpoint's
    ``input_global_scale`` (compressed-tensors' ``448 * 6 / amax``)."""
    assert gs is not None, "NVFP4 inputs need their calibrated global scale"
    gs = gs.to(torch.float32)
    values, scale = nvfp4_blocks(x, gs)
    return (values * (scale / gs)).flatten(-2)


def nvfp4_blocks(x: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ref_nvfp4_quant(x, gs, 16)``: E2M1 values [..., K/16, 16] and fp8 block scales
    [..., K/16, 1], float32, for a float32 global scale ``gs``."""
    blocks = x.unflatten(-1, (-1, NVFP4_BLOCK))  # [..., K/16, 16]
    block_amax = blocks.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = (gs * (block_amax * FP4_RECIPROCAL)).clamp(-FP8_MAX, FP8_MAX)
    scale = scale.to(torch.float8_e4m3fn).to(torch.float32)
    inverse = _reciprocal(scale * _reciprocal(gs))
    values = round_e2m1((blocks.to(torch.float32) * inverse).clamp(-FP4_MAX, FP4_MAX))
    return values, scale


def _reciprocal(t: torch.Tensor) -> torch.Tensor:
    """vLLM's ``get_reciprocal`` (nvfp4_emulation_utils.py): 1/t, with 1/(0 + 1e8) for a zero."""
    return 1.0 / (t + (t == 0) * 1e8)


@dataclass(frozen=True)
class InputScheme:
    """How one compressed-tensors input strategy (``serving.Activations.strategy``) is served."""

    # (x, the module's calibrated scale or None) -> x dequantized, float32
    quantize: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    # a module's input amax (in its weight's dtype) -> the scale the checkpoint stores, as
    # llm-compressor calibrates it (compressed-tensors); None: scales from each input
    calibrated: Callable[[torch.Tensor], torch.Tensor] | None


INPUT_SCHEMES = {
    "token": InputScheme(fp8_per_token, None),
    "tensor": InputScheme(fp8_per_tensor, amax_scale),
    # generate_gparam: 448 * 6 / amax (the weights' global-scale arithmetic, nvfp4.global_scale)
    "tensor_group": InputScheme(nvfp4_input, global_scale),
}
