"""Byte-for-byte agreement with compressed-tensors itself (tests/ct_reference.py drives the
library's own scale math and compressors).  Codes, scales and global scales must be identical,
and so must the dequantized weights."""

import zlib

import pytest
import torch
from ct_reference import ct_dequantize, ct_quantize

from qstream.formats import FORMATS, dequantize, quantize
from qstream.formats.nvfp4 import tensor_amax


def _gaussian(shape, gen):
    return torch.randn(shape, generator=gen) * 0.02


def _heavy_tailed_with_outlier_rows(shape, gen):
    # Student-t (3 dof) body, per-row scale spread, and a few rows 50x larger than the rest.
    t = torch.distributions.StudentT(3.0)
    with torch.random.fork_rng():  # StudentT draws from the global generator: seed it locally
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        body = t.sample(shape)
    w = body * 0.01 * torch.exp(torch.randn(shape[0], 1, generator=gen) * 0.5)
    w[:: max(1, shape[0] // 3)] *= 50.0
    return w


def _tiny(shape, gen):
    return torch.randn(shape, generator=gen) * 1e-30  # scales near the bottom of the range


def _rows_and_blocks_of_zeros(shape, gen):
    w = torch.randn(shape, generator=gen) * 0.05
    w[1] = 0.0
    w[3, :32] = 0.0
    w[5, 16:48] = 0.0
    return w


DISTRIBUTIONS = {
    "gaussian": _gaussian,
    "heavy": _heavy_tailed_with_outlier_rows,
    "tiny": _tiny,
    "zeros": _rows_and_blocks_of_zeros,
}
SHAPES = [(8, 64), (96, 256), (33, 1024)]


def _assert_same_bytes(ours: dict, ref: dict, what: str) -> None:
    assert set(ours) == set(ref), f"{what}: stored {sorted(ours)} vs {sorted(ref)}"
    for key, a in ours.items():
        b = ref[key]
        assert a.dtype == b.dtype, f"{what} {key}: dtype {a.dtype} vs {b.dtype}"
        assert a.shape == b.shape, f"{what} {key}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        a8 = a.contiguous().view(torch.uint8)
        b8 = b.contiguous().view(torch.uint8)
        mismatch = (a8 != b8).sum().item()
        assert mismatch == 0, f"{what} {key}: {mismatch} differing bytes"


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_weights_match_compressed_tensors(fmt, dist, shape):
    # crc32, not hash(): str hashes are salted per process, so a failure could not be replayed
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt}/{dist}/{shape}".encode()))
    w = DISTRIBUTIONS[dist](shape, gen).to(torch.bfloat16)
    ref = ct_quantize(fmt, w)
    ours = quantize(fmt, w)
    _assert_same_bytes(ours, ref, f"{fmt}/{dist}/{shape}")
    ref_w = ct_dequantize(fmt, ref)
    our_w = dequantize(fmt, ours)
    assert our_w.dtype == ref_w.dtype
    assert torch.equal(our_w.view(torch.int16), ref_w.view(torch.int16))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp16_and_fp32_weights_match_compressed_tensors(fmt, dtype):
    gen = torch.Generator().manual_seed(7)
    w = _heavy_tailed_with_outlier_rows((48, 512), gen).to(dtype)
    _assert_same_bytes(quantize(fmt, w), ct_quantize(fmt, w), f"{fmt}/{dtype}")


def test_nvfp4_fused_pair_shares_the_global_scale_like_compressed_tensors():
    gen = torch.Generator().manual_seed(3)
    gate = (torch.randn(64, 256, generator=gen) * 0.02).to(torch.bfloat16)
    up = (torch.randn(64, 256, generator=gen) * 0.08).to(torch.bfloat16)  # larger amax
    group_amax = torch.maximum(tensor_amax(gate), tensor_amax(up))
    for member, other in ((gate, up), (up, gate)):
        ours = quantize("nvfp4", member, global_amax=group_amax)
        ref = ct_quantize("nvfp4", member, fused_with=[other])
        _assert_same_bytes(ours, ref, "fused nvfp4")
    shared = quantize("nvfp4", gate, global_amax=group_amax)["weight_global_scale"]
    assert shared.item() != quantize("nvfp4", gate)["weight_global_scale"].item()
