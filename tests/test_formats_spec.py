"""Spec tests for the number formats: docs/formats.md, value by value."""

import math

import e2m1_codes
import pytest
import torch

from qstream import QStreamError
from qstream.formats import FORMATS, dequantize, e2m1, fp8, mxfp4, nvfp4, quantize, weight_snr_db
from qstream.formats.format import E2M1_GRID

# --- E2M1 core --------------------------------------------------------------------------------


@pytest.mark.parametrize("index, value", list(enumerate(E2M1_GRID)))
def test_every_e2m1_value_is_its_own_code(index, value):
    codes = e2m1_codes.round_to_codes(torch.tensor([value, -value]))
    assert codes.tolist() == [index, 8 | index]


# One test per rounding tie (round half to even), plus points just either side of it.
TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]


@pytest.mark.parametrize("tie, expected", TIES)
def test_rounding_ties_go_to_even(tie, expected):
    t = torch.tensor([tie, -tie], dtype=torch.float32)
    values = e2m1_codes.decode(e2m1_codes.round_to_codes(t))
    assert values.tolist() == [expected, -expected]


@pytest.mark.parametrize("tie, _", TIES)
def test_neighbours_of_a_tie_round_to_nearest(tie, _):
    below = torch.nextafter(torch.tensor(tie), torch.tensor(0.0))
    above = torch.nextafter(torch.tensor(tie), torch.tensor(10.0))
    grid = torch.tensor(E2M1_GRID)
    for x in (below, above):
        got = e2m1_codes.decode(e2m1_codes.round_to_codes(x.reshape(1))).item()
        nearest = grid[(grid - x).abs().argmin()].item()
        assert got == nearest, f"{x.item()!r} rounded to {got}, nearest grid value is {nearest}"


def test_saturation_at_six():
    codes = e2m1_codes.round_to_codes(torch.tensor([6.0, 7.0, 1e30, -6.5, -1e30]))
    assert e2m1_codes.decode(codes).tolist() == [6.0, 6.0, 6.0, -6.0, -6.0]


def test_all_16_codes_survive_pack_unpack():
    codes = torch.arange(16, dtype=torch.uint8).reshape(1, 16)
    packed = e2m1_codes.pack(codes)
    assert packed.shape == (1, 8)
    assert torch.equal(e2m1_codes.unpack(packed), codes)
    # element 2j in the low nibble, 2j+1 in the high nibble
    assert packed[0, 0].item() == 0x10 and packed[0, 7].item() == 0xFE


def test_negative_zero_keeps_its_sign():
    codes = e2m1_codes.round_to_codes(torch.tensor([-0.0, -0.1, 0.0]))
    assert codes.tolist() == [8, 8, 0]
    values = e2m1_codes.decode(codes)
    assert torch.signbit(values).tolist() == [True, True, False]


def test_odd_number_of_codes_cannot_be_packed():
    with pytest.raises(ValueError, match="odd"):
        e2m1_codes.pack(torch.zeros(2, 3, dtype=torch.uint8))


# --- FP8 --------------------------------------------------------------------------------------


def test_fp8_saturates_at_448_and_scale_is_amax_over_448():
    w = torch.tensor([[448.0, -448.0, 1.0, 0.5]], dtype=torch.bfloat16)
    q, scale = fp8.quantize(w)
    assert scale.dtype == torch.bfloat16 and scale.shape == (1, 1)
    assert scale.item() == 1.0
    assert q.float().tolist() == [[448.0, -448.0, 1.0, 0.5]]


def test_fp8_zero_row_gets_the_dtype_eps():
    w = torch.zeros(3, 8, dtype=torch.bfloat16)
    w[1] = 1.0
    q, scale = fp8.quantize(w)
    eps = torch.finfo(torch.bfloat16).eps
    expected_row_scale = (torch.tensor(1.0, dtype=torch.bfloat16) / 448).item()
    assert scale[:, 0].tolist() == [eps, expected_row_scale, eps]
    assert torch.equal(q[0].float(), torch.zeros(8))


# --- MXFP4 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "amax, e8m0",
    [
        (1.0, 125),  # 2**0 -> 127 + 0 - 2
        (1.5, 125),  # mantissa below 0.75 of the binade stays
        (1.75, 126),  # >= 1.75 * 2**e moves up to 2**(e+1)
        (6.0, 127),  # 6 = 1.5 * 2**2 -> 2**2 -> 127
        (7.0, 128),  # 7 = 1.75 * 2**2 -> 2**3
        (2.0**-130, 0),  # clamped at 0
    ],
)
def test_mxfp4_e8m0_rule(amax, e8m0):
    w = torch.zeros(1, 32, dtype=torch.float32)
    w[0, 0] = amax
    _, scale = mxfp4.quantize(w)
    assert scale.tolist() == [[e8m0]]


def test_mxfp4_zero_block_and_all_zero_tensor_get_scale_zero():
    w = torch.zeros(2, 64, dtype=torch.bfloat16)
    w[0, 40] = 3.0
    packed, scale = mxfp4.quantize(w)
    assert scale.tolist() == [[0, 126], [0, 0]]  # 3.0 -> 2**1 -> 127 + 1 - 2
    assert packed.any()  # the one nonzero element is coded
    assert torch.equal(mxfp4.dequantize(packed, scale).float(), w.float())


def test_mxfp4_saturates_at_six_times_scale():
    w = torch.full((1, 32), 0.1, dtype=torch.float32)
    w[0, 0] = 7.0  # rounds up to 2**3, so scale 2**1; 7/2 = 3.5 -> 4 (tie to even)
    packed, scale = mxfp4.quantize(w)
    assert mxfp4.dequantize(packed, scale, torch.float32)[0, 0].item() == 8.0
    w[0, 0] = 13.0  # 13 -> 2**3 (1.625 < 1.75), scale 2**1: 6.5 saturates at 6 -> 12
    packed, scale = mxfp4.quantize(w)
    assert mxfp4.dequantize(packed, scale, torch.float32)[0, 0].item() == 12.0


# --- NVFP4 ------------------------------------------------------------------------------------


def test_nvfp4_all_zero_tensor_gets_global_scale_one_and_block_scale_eighth():
    packed, scale, gs = nvfp4.quantize(torch.zeros(2, 32, dtype=torch.bfloat16))
    assert gs.dtype == torch.float32 and gs.tolist() == [1.0]
    assert scale.dtype == torch.float8_e4m3fn and scale.float().unique().tolist() == [0.125]
    assert packed.unique().tolist() == [0]


def test_nvfp4_zero_block_gets_block_scale_eighth():
    w = torch.zeros(1, 32, dtype=torch.bfloat16)
    w[0, 20] = 1.0
    _, scale, gs = nvfp4.quantize(w)
    assert scale.float()[0, 0].item() == 0.125
    assert scale.float()[0, 1].item() == 448.0  # the block holding the tensor amax
    assert gs.item() == 2688.0


def test_nvfp4_shared_global_amax_sets_the_global_scale():
    w = torch.ones(1, 16, dtype=torch.bfloat16)
    _, _, own = nvfp4.quantize(w)
    _, _, shared = nvfp4.quantize(w, global_amax=torch.tensor(4.0))
    assert own.item() == 2688.0 and shared.item() == 672.0


# --- shapes and bad values --------------------------------------------------------------------


@pytest.mark.parametrize("fmt, k", [("mxfp4", 48), ("nvfp4", 24)])
def test_k_not_a_multiple_of_the_block_names_the_shape(fmt, k):
    with pytest.raises(QStreamError, match=rf"layers\.0\.mlp\.up_proj\.weight.*\(4, {k}\)"):
        quantize(fmt, torch.zeros(4, k), name="layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_names_the_tensor(fmt, bad):
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w[2, 33] = bad
    with pytest.raises(QStreamError, match=r"o_proj\.weight: weight contains NaN or Inf"):
        quantize(fmt, w, name="o_proj.weight")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_nan_is_caught_even_with_a_shared_global_amax(fmt):
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    w[0, 0] = math.nan
    kwargs = {"global_amax": torch.tensor(1.0)} if fmt == "nvfp4" else {}
    with pytest.raises(QStreamError, match="NaN or Inf"):
        quantize(fmt, w, name="x", **kwargs)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rejects_non_2d_and_integer_weights(fmt):
    with pytest.raises(QStreamError, match="2-D"):
        quantize(fmt, torch.zeros(64), name="norm.weight")
    with pytest.raises(QStreamError, match="dtype"):
        quantize(fmt, torch.zeros(4, 64, dtype=torch.int32), name="w")


def test_unknown_format_is_a_clear_error():
    with pytest.raises(QStreamError, match="unknown format 'int4'"):
        quantize("int4", torch.zeros(4, 64))


def test_input_is_never_modified():
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(8, 64, generator=gen).to(dtype)
        before = w.clone()
        for fmt in FORMATS:
            quantize(fmt, w)
        assert torch.equal(w, before)


def test_weight_snr_matches_its_definition():
    w = torch.tensor([[3.0, 4.0]])
    w_hat = torch.tensor([[3.0, 3.0]])
    assert weight_snr_db(w, w_hat) == pytest.approx(10 * math.log10(25.0 / 1.0), abs=1e-12)
    assert weight_snr_db(w, w) == math.inf


@pytest.mark.parametrize(
    "fmt, row",
    [
        ("fp8", [448.0, -224.0, 1.5, 0.015625]),  # amax 448 -> scale 1; all fp8-exact
        ("mxfp4", [6.0, -3.0, 1.5, 0.5]),  # amax 6 -> 2**2 -> scale 1
        ("nvfp4", [6.0, -3.0, 1.5, 0.5]),  # gs = 448, block scale 448 -> divisor 1
    ],
)
def test_exactly_representable_weights_round_trip_unchanged(fmt, row):
    w = torch.tensor([row * 8], dtype=torch.bfloat16)
    assert torch.equal(dequantize(fmt, quantize(fmt, w)), w)


# Round-half-to-even decision points between neighbouring grid values, as (threshold, inclusive):
# |y| moves up one index when |y| > t (exclusive) or |y| >= t (inclusive).  Inclusive exactly
# where the upper neighbour has the even mantissa: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
# 3.5->4, 5->4 (docs/formats.md; compressed-tensors' cast_to_fp4 uses the same points).
E2M1_STEPS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def _threshold_codes(y: torch.Tensor) -> torch.Tensor:
    """docs/formats.md's definition, written independently: count the decision points |y| passes."""
    a = y.abs()
    index = torch.zeros(a.shape, dtype=torch.uint8)
    for threshold, inclusive in E2M1_STEPS:
        index += (a >= threshold) if inclusive else (a > threshold)
    return index | (torch.signbit(y).to(torch.uint8) << 3)


def test_bit_trick_rounding_equals_the_threshold_definition_near_every_tie():
    # every float32 within 3000 ulps of each tie and grid point, both signs, plus subnormals,
    # huge values and a dense random sweep of [-8, 8]
    points = torch.tensor(
        [
            0.25,
            0.75,
            1.25,
            1.75,
            2.5,
            3.5,
            5.0,
            0.5,
            1.0,
            1.5,
            2.0,
            3.0,
            4.0,
            6.0,
            1e-40,
            1e-30,
            7.0,
        ]
    )
    offsets = torch.arange(-3000, 3001, dtype=torch.int32)
    near = (points.view(torch.int32)[:, None] + offsets).view(torch.float32).flatten()
    gen = torch.Generator().manual_seed(0)
    y = torch.cat(
        [
            near,
            -near,
            torch.rand(1_000_000, generator=gen) * 16 - 8,
            torch.tensor([0.0, -0.0, 1e30, -1e30, float("inf"), -float("inf")]),
        ]
    )
    y = y[~torch.isnan(y)]
    assert torch.equal(e2m1_codes.round_to_codes(y), _threshold_codes(y))
    assert torch.equal(
        e2m1_codes.encode_packed(y[: y.numel() // 2 * 2].reshape(2, -1)),
        e2m1_codes.pack(_threshold_codes(y[: y.numel() // 2 * 2]).reshape(2, -1)),
    )


def test_decoding_packed_bytes_equals_unpack_then_decode():
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    for dtype in (torch.float32, torch.bfloat16):
        direct = e2m1.decode_packed(every_byte, dtype)
        two_step = e2m1_codes.decode(e2m1_codes.unpack(every_byte), dtype)
        assert torch.equal(
            direct.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            two_step.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        )


def test_fp8_magnitudes_decode_every_code_as_torch_does():
    """The FP8 quantizer's SNR decodes the stored codes with integer arithmetic; every finite
    E4M3 code, subnormals and both zeros included, must give torch's cast's magnitude."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[torch.isfinite(codes.float())]
    assert codes.numel() == 254  # all but the two NaNs
    expected = codes.float().abs()
    got = fp8.decode_magnitudes(codes)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_dequantize_equals_the_cast_times_the_scale_for_every_code(dtype):
    """dequantize decodes codes with integer arithmetic; for all 256 codes (NaNs and both
    zeros included) in every row, times per-row scales spanning the dtype's range, it must
    equal compressed-tensors' ``q.to(dtype) * scale`` bit for bit."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(40, 3)
    codes = codes[:, torch.randperm(768, generator=gen)].view(torch.float8_e4m3fn)
    tiny, big = torch.finfo(dtype).tiny, torch.finfo(dtype).max / 448
    exponents = torch.linspace(math.log2(tiny), math.log2(big), 39)
    scale = torch.cat([2**exponents * 1.37, torch.ones(1)]).to(dtype).reshape(40, 1)
    expected = codes.to(dtype) * scale
    got = fp8.dequantize(codes, scale)
    assert got.dtype == dtype and got.shape == expected.shape
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    same = got.view(bits) == expected.view(bits)
    assert bool((same | (got.isnan() & expected.isnan())).all())
