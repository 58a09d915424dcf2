"""The drafting head quantized online, as vLLM 0.33.0 serves
``speculative_config.draft_lm_head_quantization`` (``+head=fp8`` / ``+head=nvfp4``,
docs/eval-drift.md "A quantized drafting head"): at load a quantized copy of the bf16 lm_head
(vllm/model_executor/layers/quantization/online/lm_head.py, ``_quantize_copy``), then every
head product through it.  ``HEADS[name](weight)`` takes the head in the model's dtype and
returns ``x [..., H] -> logits [..., V]`` in x's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from qstream.formats.activations import fp8_per_token_codes, nvfp4_blocks
from qstream.formats.format import FP4_MAX, FP8_MAX

# Row chunks of this many elements upcast to float32 per product (32 MiB), as ComputeWeights.
CHUNK_ELEMENTS = 1 << 23
Head = Callable[[torch.Tensor], torch.Tensor]


def fp8_head(weight: torch.Tensor) -> Head:
    """``Fp8PtpcOnlineLinearMethod`` (online/fp8.py).  At load, per row (``_fp8_channel_scale``,
    ``_fp8_quant_per_channel``): ``s = max(amax / 448, 1/(448*512))`` in float32 (a 0-d fp32
    divisor: true division) and codes ``fp8(clamp(w / s, +-448))``, the bf16 weight divided by
    the fp32 scale in float32.  Not compressed-tensors' FP8 (qstream/formats/fp8.py): that
    divides in the weight's dtype and gives a zero row the dtype's eps.  Per product: the
    dynamic per-token input (``QuantFP8`` as a=fp8-dynamic, qstream/formats/activations.py),
    the codes multiplied with a float32 accumulation, then ``acc * x_scale * w_scale`` in float32,
    rounded once (kernels/linear/scaled_mm/pytorch.py,
    ``ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm``)."""
    amax = weight.abs().amax(dim=-1, keepdim=True).float()
    fp8_max = torch.tensor(FP8_MAX, dtype=torch.float32)
    scale = (amax / fp8_max).clamp_min(1.0 / (fp8_max * 512))
    codes = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    for rows in _row_chunks(weight):  # a float32 quotient of the whole head at K3 scale: 4.7 GB
        codes[rows] = (weight[rows] / scale[rows]).clamp_(-FP8_MAX, FP8_MAX)
    row_scale = scale.t()  # [1, V]

    def head(x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = fp8_per_token_codes(x)
        return (_products(xq, codes) * x_scale * row_scale).to(x.dtype)

    return head


def nvfp4_head(weight: torch.Tensor) -> Head:
    """``_LMHeadNvfp4Method`` (online/lm_head.py), weight-only.  At load (``_quantize_nvfp4``):
    the dequantization global scale ``g = max(amax(|W|) / (6*448), 1e-12)`` in float32 (vLLM's
    convention, not compressed-tensors' ``448*6/amax``, which is its reciprocal computed in the
    weight's dtype: qstream/formats/nvfp4.py), divided as CUDA divides a float32 tensor by a
    Python float, times its float32 reciprocal; then ``ref_nvfp4_quant(W, 1/g, 16)`` (fp8 block
    scales and E2M1 values, qstream/formats/activations.py ``nvfp4_blocks``).  Per product: the
    W4A16 kernels multiply the bf16 input with ``E2M1 * block scale`` (exact) in float32 and
    apply ``g`` after the sum (Marlin: ``nvfp4_marlin_process_global_scale``,
    quantization/utils/marlin_utils_fp4.py), rounded once.  Not followed: the emulation kernel
    (VLLM_BATCH_INVARIANT without CUTLASS) folds ``g`` into a bf16 weight first."""
    if weight.shape[-1] % 16:
        raise ValueError(f"an NVFP4 head needs a hidden size divisible by 16, not {weight.shape}")
    amax = weight.abs().amax().float()
    g = (amax * torch.tensor(FP4_MAX * FP8_MAX, dtype=torch.float32).reciprocal()).clamp(min=1e-12)
    values, scales = nvfp4_blocks(weight, 1.0 / g)
    unit = (values * scales).flatten(-2).to(weight.dtype)  # exact: 2 x 4 significant bits

    def head(x: torch.Tensor) -> torch.Tensor:
        return (_products(x.float(), unit) * g).to(x.dtype)

    return head


def _row_chunks(weight: torch.Tensor) -> list[slice]:
    n, k = weight.shape
    chunk = max(1, CHUNK_ELEMENTS // k)
    return [slice(r, r + chunk) for r in range(0, n, chunk)]


def _products(x32: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x32 @ weight^T`` in float32, the weight upcast (exactly) a row chunk at a time."""
    return torch.cat([F.linear(x32, weight[r].float()) for r in _row_chunks(weight)], dim=-1)


HEADS: dict[str, Callable[[torch.Tensor], Head]] = {"fp8": fp8_head, "nvfp4": nvfp4_head}
