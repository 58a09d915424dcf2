"""The activation schemes (qstream/formats/activations.py) against vLLM 0.32.0's own reference
ops, bit for bit: ``QuantFP8.forward_native`` per token and static per tensor
(vllm/model_executor/layers/quantization/input_quant_fp8.py), and ``ref_nvfp4_quant``
(vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py), dequantized as
``ref_nvfp4_quant_dequant`` does but kept in float32 (docs/eval-drift.md, "Serving
configurations")."""

import pytest
import torch

from qstream.formats.activations import fp8_per_tensor, fp8_per_token, nvfp4_input

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # a CustomOp asks for it when built
        yield


def _inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=gen) * torch.exp(2 * torch.randn(64, 1, generator=gen))
    x[0] = 0  # the per-token scale floor
    x[1, 3] = 1e4  # saturates a static scale
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_matches_vllms_quant_fp8(vllm_config, dtype):
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    x = _inputs(dtype)
    q, scale = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN).forward_native(x)
    assert torch.equal(fp8_per_token(x), q.float() * scale)
    static = torch.tensor([0.0173])
    q, _ = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR).forward_native(x, static)
    assert torch.equal(fp8_per_tensor(x, static), q.float() * static)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("amax", [1.0, 37.5, 3e4])
def test_nvfp4_matches_vllms_reference_quant(dtype, amax):
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        ref_nvfp4_quant,
    )

    x = _inputs(dtype)
    gs = torch.tensor([448 * 6 / amax], dtype=torch.float32)
    fp4, block_scale = ref_nvfp4_quant(x, gs, 16)
    expected = (fp4.unflatten(-1, (-1, 16)) * (block_scale.unsqueeze(-1) / gs)).flatten(-2)
    assert torch.equal(nvfp4_input(x, gs), expected)
