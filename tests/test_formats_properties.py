"""Property tests (hypothesis): re-quantizing a dequantized weight gives the same codes,
packing is a bijection, scales are finite and positive (FP8, NVFP4) and MXFP4's puts each block
where docs/formats say, and the weight SNR sums the quantizers accumulate equal the definition's
second pass over the dequantized weight."""

import e2m1_codes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from qstream.formats import FORMATS, Energy, dequantize, mxfp4, quantize, snr_db, snr_sums
from qstream.formats.format import E2M1_GRID

CODES = {"fp8": "weight", "mxfp4": "weight_packed", "nvfp4": "weight_packed"}

finite_floats = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32)


@st.composite
def weights(draw):
    rows = draw(st.integers(1, 6))
    blocks = draw(st.integers(1, 4))
    scale = draw(st.sampled_from([1e-6, 1e-2, 1.0, 1e3]))
    values = draw(arrays(np.float32, (rows, 32 * blocks), elements=finite_floats))
    return (torch.from_numpy(values) * scale).to(torch.bfloat16)


@settings(max_examples=60, deadline=None)
@given(w=weights(), fmt=st.sampled_from(sorted(FORMATS)))
def test_dequantized_weight_requantizes_to_the_same_codes(w, fmt):
    stored = quantize(fmt, w)
    again = quantize(fmt, dequantize(fmt, stored))
    key = CODES[fmt]
    assert torch.equal(again[key].view(torch.uint8), stored[key].view(torch.uint8))


# The in-kernel sums square the same exact float32 differences as snr_sums but sum each row in
# float32 (energy.row_square_sums; the terms are non-negative, so the error is a few float32
# ulps of the row's sum) and only the rows in float64.  2**-20 leaves the printed SNR (2
# decimals) unchanged, which the tests check too.
SNR_SUM_RTOL = 2.0**-20


@settings(max_examples=90, deadline=None)
@given(
    w=weights(),
    fmt=st.sampled_from(sorted(FORMATS)),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
)
def test_in_kernel_snr_sums_equal_the_second_pass(w, fmt, dtype):
    w = w.float().clamp(-60000, 60000).to(dtype)  # within fp16's range
    energy = Energy()
    stored = quantize(fmt, w, energy=energy)
    expected = snr_sums(w, dequantize(fmt, stored, dtype=dtype))
    got = energy.sums()
    for a, b in zip(got, expected):
        assert abs(a - b) <= SNR_SUM_RTOL * abs(b), (got, expected)
    assert f"{snr_db(*got):.2f}" == f"{snr_db(*expected):.2f}"


def test_in_kernel_snr_sums_on_a_multi_chunk_weight():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(700, 1024, generator=gen) * 0.02
    w[5] = 0  # an all-zero row, and outliers that saturate blocks
    w[7, ::97] = 3.0
    w = w.bfloat16()
    for fmt in FORMATS:
        energy = Energy()
        stored = quantize(fmt, w, energy=energy)
        expected = snr_sums(w, dequantize(fmt, stored, dtype=w.dtype))
        for a, b in zip(energy.sums(), expected):
            assert abs(a - b) <= SNR_SUM_RTOL * abs(b), (fmt, energy.sums(), expected)
        assert f"{snr_db(*energy.sums()):.2f}" == f"{snr_db(*expected):.2f}"


@settings(max_examples=60, deadline=None)
@given(w=weights(), fmt=st.sampled_from(["fp8", "nvfp4"]))
def test_scales_are_finite_and_positive(w, fmt):
    stored = quantize(fmt, w)
    for key, t in stored.items():
        if not key.startswith("weight_") or key == "weight_packed":
            continue
        values = t.float()
        assert torch.isfinite(values).all(), key
        assert (values > 0).all(), key


@settings(max_examples=60, deadline=None)
@given(w=weights())
def test_mxfp4_scale_puts_the_block_amax_in_the_top_binades(w):
    # An E8M0 byte decodes to 2^(e - 127), finite and positive whatever it holds, so the check
    # above says nothing for MXFP4.  docs/formats.md's rule does: amax = m * 2^E with m in
    # [1, 1.75) gets scale 2^(E-2), so amax / scale = 4m in [4, 7); m in [1.75, 2) rounds up to
    # 2^(E+1), scale 2^(E-1), amax / scale = 2m in [3.5, 4).  A block whose exponent clamps at
    # 0 (zero or tiny) only stays below 7.
    code = quantize("mxfp4", w)["weight_scale"].long()  # [N, K/32] E8M0 bytes
    amax = w.double().abs().unflatten(-1, (-1, 32)).amax(-1)
    ratio = amax / torch.pow(2.0, (code - 127).double())
    high = ratio.max().item()
    low = ratio[code > 0].min().item() if (code > 0).any() else 3.5
    assert 3.5 <= low and high < 7, f"amax / scale spans [{low}, {high}], expected [3.5, 7)"


@settings(max_examples=100, deadline=None)
@given(
    arrays(np.uint8, st.tuples(st.integers(1, 4), st.integers(1, 16)), elements=st.integers(0, 255))
)
def test_packing_is_a_bijection(packed_np):
    packed = torch.from_numpy(packed_np)
    codes = e2m1_codes.unpack(packed)
    assert codes.shape == (packed.shape[0], packed.shape[1] * 2)
    assert int(codes.max()) <= 15
    assert torch.equal(e2m1_codes.pack(codes), packed)
    assert torch.equal(e2m1_codes.unpack(e2m1_codes.pack(codes)), codes)


def test_mxfp4_products_of_a_bf16_weight_are_bf16_values():
    # mxfp4.quantize's SNR skips dequantize's rounding to bf16 (encode_blocks' exact): every
    # E2M1 magnitude times every E8M0 scale decoded in bf16 must already be a bf16 value.
    scales = mxfp4.decode_scale(torch.arange(256).to(torch.uint8), torch.bfloat16).float()
    products = torch.tensor(E2M1_GRID)[:, None] * scales[None, :]  # [8, 256], float32
    torch.testing.assert_close(
        products.bfloat16().float(), products, rtol=0, atol=0, equal_nan=True
    )


@settings(max_examples=60, deadline=None)
@given(w=weights(), shift=st.sampled_from([-126, -100, 0, 60, 100]))
def test_mxfp4_snr_sums_without_the_rounding_are_the_same_bits(w, shift):
    w = (w.float() * 2.0**shift).bfloat16()  # down to bf16 subnormals, up near its max
    rounded, skipped = Energy(), Energy()
    mxfp4.quantize(w, energy=skipped)
    encode = mxfp4.encode_blocks
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mxfp4, "encode_blocks", lambda *a, **kw: encode(*a, **kw | {"exact": False}))
        mxfp4.quantize(w, energy=rounded)
    assert skipped.sums() == rounded.sums()
