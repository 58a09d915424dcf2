"""The drafting head quantized at load, as vLLM 0.33.0's
``speculative_config.draft_lm_head_quantization`` serves it (qstream/formats/head.py;
docs/eval-drift.md, "A quantized drafting head"): bit-exact against vLLM 0.33.0's op sequence
transcribed here from vllm/model_executor/layers/quantization/online/{lm_head,fp8}.py, and
eval-drift end to end with ``+head=``."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import cli_ok
from click.testing import CliRunner
from test_activations import cast_to_fp4, get_reciprocal  # nvfp4_emulation_utils.py, as written

from qstream.cli import cli
from qstream.formats.head import HEADS


def _weight(seed: int, rows: int = 300, cols: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
    w[3] = 0.0  # an all-zero row: the scale floors
    w[5, 7] = 1e4  # an outlier: other blocks' scales underflow fp8
    return w.to(torch.bfloat16)


def _input(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(2, 5, 64, generator=g) * 3
    x[0, 1] = 0.0  # a zero token: its dynamic scale floors
    return x.to(torch.bfloat16)


def vllm_fp8_head(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Fp8PtpcOnlineLinearMethod.process_weights_after_loading (weight_amax, _fp8_channel_scale,
    _fp8_quant_per_channel), then QuantFP8.forward_native per token and
    ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm (``output * x_scale * Bs.t()``)."""
    lo, hi = weight.aminmax(dim=-1, keepdim=True)
    amax = torch.maximum(lo.abs(), hi.abs())
    fp8_max = torch.tensor(448.0, dtype=torch.float32)
    weight_scale = (amax.to(torch.float32) / fp8_max).clamp_min(1.0 / (fp8_max * 512))
    qweight = (weight / weight_scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    x2 = x.reshape(-1, x.shape[-1])
    x_max = x2.abs().amax(dim=-1).unsqueeze(-1).to(torch.float32)
    x_scale = (x_max / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    qx = (x2.to(torch.float32) * x_scale.reciprocal()).clamp(-448.0, 448.0)
    qx = qx.to(torch.float8_e4m3fn)
    output = qx.float() @ qweight.float().t()  # _scaled_mm with unit scales, float32 out
    output = output * x_scale * weight_scale.t()
    return output.to(x.dtype).reshape(*x.shape[:-1], -1)


def vllm_nvfp4_head(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """_quantize_nvfp4 (ref_nvfp4_quant over the rows, codes packed and unpacked), then the W4A16
    product with the global scale after the sum (apply_fp4_marlin_linear's epilogue)."""
    lo, hi = weight.aminmax()
    amax = torch.maximum(lo.abs(), hi.abs())
    # ``amax.float() / (6.0 * 448.0)``: CUDA divides a float32 tensor by a Python float as a
    # product with its float32 reciprocal
    inv_2688 = torch.tensor(2688.0, dtype=torch.float32).reciprocal()
    global_scale = (amax.float() * inv_2688).clamp(min=1e-12)
    inv_global_scale = (1.0 / global_scale).reshape(())
    m, n = weight.shape
    xb = weight.reshape(m, n // 16, 16)
    vec_max = torch.max(torch.abs(xb), dim=-1, keepdim=True)[0].to(torch.float32)
    scale = inv_global_scale * (vec_max * (1 / 6.0))
    scale = torch.clamp(scale, max=448, min=-448).to(torch.float8_e4m3fn).to(torch.float32)
    output_scale = get_reciprocal(scale * get_reciprocal(inv_global_scale))
    clipped = torch.clamp(xb.to(torch.float32) * output_scale, -6.0, 6.0).reshape(m, n)
    values = cast_to_fp4(clipped)
    unit = (values.reshape(m, n // 16, 16) * scale).reshape(m, n)
    return ((x.float() @ unit.t()) * global_scale).to(x.dtype)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name, vllm", [("fp8", vllm_fp8_head), ("nvfp4", vllm_nvfp4_head)])
def test_the_head_is_vllms_to_the_bit(name, vllm, seed):
    weight, x = _weight(seed), _input(seed)
    ours = HEADS[name](weight)(x)
    assert ours.dtype == torch.bfloat16 and torch.isfinite(ours).all()
    assert torch.equal(ours, vllm(weight, x))
    assert not torch.equal(ours, F.linear(x, weight))  # the head did change


def test_nvfp4_global_scale_is_vllms_not_compressed_tensors():
    """vLLM 0.33.0 dequantizes with amax/(6*448) in fp32; compressed-tensors' 448*6/amax is its
    reciprocal computed in bf16: a head built on the latter differs."""
    from qstream.formats.activations import nvfp4_blocks
    from qstream.formats.nvfp4 import global_scale, tensor_amax

    weight, x = _weight(4), _input(4)
    ct_gs = global_scale(tensor_amax(weight)).float()
    values, scales = nvfp4_blocks(weight, ct_gs)
    ct = ((x.float() @ (values * scales).flatten(-2).t()) / ct_gs).to(x.dtype)
    assert torch.equal(HEADS["nvfp4"](weight)(x), vllm_nvfp4_head(weight, x))
    assert not torch.equal(ct, vllm_nvfp4_head(weight, x))


@pytest.mark.parametrize("arch", ["k3", "qwen3"])
def test_eval_drift_reports_what_a_quantized_head_costs(arch, tiny, tmp_path):
    model = tiny
    if arch == "qwen3":
        model = tmp_path / "qwen3"
        cli_ok(["synth", "--preset", "qwen3-tiny", "--output_dir", str(model)])
    results = tmp_path / "results.json"
    formats = "bf16,bf16+head=fp8,bf16+head=nvfp4"
    cli_ok(["eval-drift", "--model", str(model), "--regime", "heavy", "--blocks", "16",
            "--formats", formats, "--json", str(results)])  # fmt: skip
    data = json.loads(results.read_text())
    assert "configuration" not in data["variants"]["bf16"]
    for head in ("fp8", "nvfp4"):
        assert data["variants"][f"bf16+head={head}"]["configuration"]["head"] == head
    kl = {
        n: v["metrics"]["kl"]["mean"]["value"]
        for n, v in data["regimes"]["heavy"]["variants"].items()
    }
    assert all(math.isfinite(v) for v in kl.values())
    assert kl["bf16+head=fp8"] != kl["bf16"] and kl["bf16+head=nvfp4"] != kl["bf16"]
    cli_ok(["card", str(results), "--output", str(tmp_path / "CARD.md"), "--no-figures"])
    card = (tmp_path / "CARD.md").read_text()  # the Serving conditions row: the head's own cost
    assert "| bf16+head=fp8 | drafting head fp8 | bf16 | bf16 |" in card


def test_a_bad_head_is_one_error_line(tiny, tmp_path):
    """A bad value in a --formats token is a usage error (exit 2): one Error line naming it."""
    out = tmp_path / "r.json"
    result = CliRunner().invoke(cli, ["eval-drift", "--model", str(tiny), "--regime", "heavy",
                                      "--formats", "bf16+head=int4", "--json", str(out)])  # fmt: skip
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert errors == [
        "Error: Invalid value for '--formats': variant bf16+head=int4: head 'int4': "
        "choose one of stored, fp8, nvfp4"
    ]
    assert not out.exists()
