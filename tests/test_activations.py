"""The activation schemes (qstream/formats/activations.py) against independent transcriptions of
vLLM 0.32.0's reference ops, bit for bit: ``QuantFP8.forward_native``
(vllm/model_executor/layers/quantization/input_quant_fp8.py) and ``ref_nvfp4_quant`` with its
threshold ``cast_to_fp4`` (vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py);
and the calibrated scales and per-token FP8 against compressed-tensors' own functions."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from qstream.formats.activations import (
    INPUT_SCHEMES,
    fp8_per_tensor,
    fp8_per_token,
    nvfp4_input,
)
from qstream.formats.e2m1 import round_e2m1
from qstream.formats.format import E2M1_GRID

# --- transcriptions of vLLM's code (not qstream's) ---


def vllm_quant_fp8(x, scale=None):
    """QuantFP8.forward_native, per-token when ``scale`` is None, else static per-tensor."""
    if scale is None:
        x_max = x.abs().amax(dim=-1).unsqueeze(-1).to(torch.float32)
        scale = (x_max / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    out = x.to(torch.float32) * scale.to(torch.float32).reciprocal()
    return out.clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale.to(torch.float32)


def cast_to_fp4(x):
    sign = torch.sign(x)
    x = torch.abs(x)
    x[(x >= 0.0) & (x <= 0.25)] = 0.0
    x[(x > 0.25) & (x < 0.75)] = 0.5
    x[(x >= 0.75) & (x <= 1.25)] = 1.0
    x[(x > 1.25) & (x < 1.75)] = 1.5
    x[(x >= 1.75) & (x <= 2.5)] = 2.0
    x[(x > 2.5) & (x < 3.5)] = 3.0
    x[(x >= 3.5) & (x <= 5.0)] = 4.0
    x[x > 5.0] = 6.0
    return x * sign


def get_reciprocal(x):
    return 1.0 / (x + (x == 0) * 1e8)


def vllm_nvfp4_quant_dequant(x, global_scale, block_size=16):
    """ref_nvfp4_quant, then ref_nvfp4_quant_dequant's dequantization (kept in float32)."""
    m, n = x.shape
    x = torch.reshape(x, (m, n // block_size, block_size))
    vec_max = torch.max(torch.abs(x), dim=-1, keepdim=True)[0].to(torch.float32)
    scale = global_scale * (vec_max * (1 / 6.0))
    scale = torch.clamp(scale, max=448, min=-448)
    scale = scale.to(torch.float8_e4m3fn).to(torch.float32)
    output_scale = get_reciprocal(scale * get_reciprocal(global_scale))
    scaled_x = x.to(torch.float32) * output_scale
    clipped_x = torch.clamp(scaled_x, -6.0, 6.0).reshape(m, n)
    x_fp4, x_blockscale = cast_to_fp4(clipped_x), scale.squeeze(-1)
    x_fp4 = x_fp4.reshape(m, n // block_size, block_size)
    return (x_fp4 * (x_blockscale.unsqueeze(-1) / global_scale)).reshape(m, n)


def inputs(dtype=torch.bfloat16, rows=64, k=128, seed=0):
    """Heavy-tailed rows with an all-zero row, a saturating outlier and a tiny row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * torch.exp(2 * torch.randn(rows, 1, generator=gen))
    x[0] = 0
    x[1, 5] = 1e4
    x[2] *= 1e-6  # its per-token scale clamps at 1/(448*512)
    return x.to(dtype)


# --- FP8 ---


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_per_token_is_vllms_forward_native(dtype):
    x = inputs(dtype).unflatten(0, (4, 16))  # leading dims: [S, T, K]
    q, scale = vllm_quant_fp8(x)
    floor = torch.tensor(1 / (448 * 512), dtype=torch.float32)
    assert scale[0, 0] == floor and scale[0, 2] == floor  # the zero row and the tiny one
    got = fp8_per_token(x)
    assert got.dtype == torch.float32
    assert torch.equal(got, q.to(torch.float32) * scale)


def test_fp8_per_tensor_is_vllms_static_forward_native():
    x = inputs()
    scale = torch.tensor(0.0173, dtype=torch.bfloat16)  # a checkpoint's bf16 input_scale
    q, s = vllm_quant_fp8(x, scale)
    got = fp8_per_tensor(x, scale)
    assert torch.equal(got, q.to(torch.float32) * s)
    assert float(got.abs().max()) == 448 * float(s)  # the outlier saturates


def test_fp8_per_token_matches_compressed_tensors_dynamic_token_scheme():
    """fp32 inputs: compressed-tensors' token scale is vLLM's (amax / 448 in fp32; no row here
    is small enough for vLLM's floor).  It divides by the scale where vLLM multiplies by the
    reciprocal; with power-of-two scales the two are the same number, so every value agrees."""
    args = QuantizationArgs(
        num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True
    )
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=gen)
    x = x / x.abs().amax(-1, keepdim=True) * 448 * 2.0 ** torch.arange(-8, 24).unsqueeze(-1)
    scale, zero = calculate_qparams(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), args)
    _, ours = vllm_quant_fp8(x)
    assert torch.equal(scale, ours)
    assert torch.equal(fake_quantize(x, scale, zero, args), fp8_per_token(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_static_scales_are_compressed_tensors(dtype):
    """The calibrated scales from an amax in the weight dtype: fp8-static's input_scale is
    ``calculate_qparams`` (tensor strategy), nvfp4's input_global_scale ``generate_gparam``."""
    amax = (torch.rand(200, generator=torch.Generator().manual_seed(2)) * 1e3).to(dtype)
    amax[0] = 0
    fp8 = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)
    for a in amax:
        scale, _ = calculate_qparams(-a.reshape(1), a.reshape(1), fp8)
        ours = INPUT_SCHEMES["tensor"].calibrated(a)
        assert ours.dtype == dtype and torch.equal(ours.reshape(1), scale), float(a)
        assert torch.equal(INPUT_SCHEMES["tensor_group"].calibrated(a), generate_gparam(-a, a))
    assert INPUT_SCHEMES["token"].calibrated is None  # dynamic: no calibration


# --- NVFP4 ---


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("amax", [1.0, 37.5, 3e4])
def test_nvfp4_input_is_vllms_reference(dtype, amax):
    x = inputs(dtype)
    gs = generate_gparam(torch.tensor(-amax), torch.tensor(amax))  # the calibrated scale
    assert torch.equal(nvfp4_input(x, gs), vllm_nvfp4_quant_dequant(x, gs))
    three_d = nvfp4_input(x.unflatten(0, (8, 8)), gs)  # any leading shape
    assert torch.equal(three_d.flatten(0, 1), nvfp4_input(x, gs))


def test_nvfp4_input_rounds_every_tie_to_even():
    """gs = 1 and a block amax of 6 make the block scale 1, so the elements are rounded as
    given: each midpoint between grid values goes to the even code."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    row = torch.tensor([6.0, *ties, *(-t for t in ties), 0.0], dtype=torch.bfloat16)
    got = nvfp4_input(row.reshape(1, 16), torch.tensor([1.0]))[0]
    assert got[1:8].tolist() == expected and got[8:15].tolist() == [-e for e in expected]
    assert torch.equal(got, vllm_nvfp4_quant_dequant(row.reshape(1, 16), torch.tensor([1.0]))[0])


def test_round_e2m1_keeps_the_grid_and_saturates():
    grid = torch.tensor([*E2M1_GRID, *(-v for v in E2M1_GRID)])
    assert torch.equal(round_e2m1(grid), grid)
    assert round_e2m1(torch.tensor([7.0, -100.0])).tolist() == [6.0, -6.0]
    assert torch.signbit(round_e2m1(torch.tensor([-0.1])))[0]
