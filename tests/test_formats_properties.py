"""Property tests (hypothesis): re-quantizing a dequantized weight gives the same codes,
packing is a bijection, scales are finite and positive."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from qstream.formats import FORMATS, dequantize, e2m1, quantize

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


@settings(max_examples=60, deadline=None)
@given(w=weights(), fmt=st.sampled_from(sorted(FORMATS)))
def test_scales_are_finite_and_positive(w, fmt):
    stored = quantize(fmt, w)
    for key, t in stored.items():
        if not key.startswith("weight_") or key == "weight_packed":
            continue
        values = t.float() if t.dtype != torch.uint8 else t.double().sub(127).exp2()
        assert torch.isfinite(values).all(), key
        assert (values > 0).all(), key


@settings(max_examples=100, deadline=None)
@given(arrays(np.uint8, st.tuples(st.integers(1, 4), st.integers(1, 16)),
              elements=st.integers(0, 255)))
def test_packing_is_a_bijection(packed_np):
    packed = torch.from_numpy(packed_np)
    codes = e2m1.unpack(packed)
    assert codes.shape == (packed.shape[0], packed.shape[1] * 2)
    assert int(codes.max()) <= 15
    assert torch.equal(e2m1.pack(codes), packed)
    assert torch.equal(e2m1.unpack(e2m1.pack(codes)), codes)
