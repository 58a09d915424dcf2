"""FP8 E4M3, one scale per output channel (docs/formats.md; compressed-tensors'
``naive-quantized`` format with ``strategy: channel``).

``scale = amax(|w[n, :]|) / 448`` and ``q = fp8(clamp(w / scale, +-448))``, both evaluated in the
weight's own dtype, exactly as compressed-tensors does for a bf16/fp16/fp32 weight."""

from __future__ import annotations

import torch

from qstream.formats.format import (
    FP8_MAX,
    ChunkWorkspace,
    Format,
    block_abs_max,
    check_finite,
    check_weight,
    chunk_rows,
    row_chunks,
)
from qstream.formats.snr import Energy


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' symmetric FP8 scale (``calculate_qparams``): ``amax / 448`` in
    amax's dtype, a zero scale becoming that dtype's eps; also a static input scale."""
    scale = amax / torch.tensor(FP8_MAX, dtype=amax.dtype)
    return torch.where(scale == 0, torch.finfo(amax.dtype).eps, scale)


def quantize(
    w: torch.Tensor, name: str = "weight", energy: Energy | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> ``(weight float8_e4m3fn [N, K], weight_scale w.dtype [N, 1])``."""
    check_weight(w, name)
    n, k = w.shape
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((n, 1), dtype=w.dtype, device=w.device)
    rows_max = chunk_rows(n, k)
    y = torch.empty((rows_max, k), dtype=w.dtype, device=w.device)  # reused: no page faults
    work = None if energy is None else ChunkWorkspace(rows_max, k, w.device, w.dtype)
    for rows in row_chunks(n, k):
        chunk, codes = w[rows], q[rows]
        scale[rows] = s = amax_scale(block_abs_max(chunk, k))  # an all-zero row: eps
        check_finite(s, name)
        quotient = torch.div(chunk, s, out=y[: rows.stop - rows.start])
        codes.copy_(quotient.clamp_(-FP8_MAX, FP8_MAX))  # round to nearest even
        if energy is not None and work is not None:
            _add_energy(energy, chunk, codes, s, work, rows)
    return q, scale


def _add_energy(energy: Energy, chunk, codes, s, work: ChunkWorkspace, rows: slice) -> None:
    """The SNR sums of one chunk in magnitudes, from the codes just stored: ``|w_hat| =
    dtype(|fp8| * s)``, :func:`dequantize`'s value.  For a 16-bit weight the code bits shifted
    into the dtype read as ``|fp8| * 2**-p``, times ``s * 2**p`` unless that overflows."""
    x, _, scratch = work.take(rows)
    torch.abs(x.copy_(chunk), out=x)
    _, hat = work.take_hat(rows)
    if hat.dtype in _SHORT_DECODE:
        shift, power = _SHORT_DECODE[hat.dtype]
        scaled = s * power
        if torch.isfinite(scaled).all():
            bits = hat.view(torch.int16).copy_(codes.view(torch.uint8))
            bits.bitwise_and_(_MAGNITUDE_BITS).bitwise_left_shift_(shift)
            hat.mul_(scaled)
            energy.add_rounded(chunk, x, hat, scratch.view(torch.float32))
            return
    energy.add(chunk, x, decode_magnitudes(codes, scratch).mul_(s.float()), hat)


_MAGNITUDE_BITS, _SIGN_BIT = 0x7F, 0x80
# A code's magnitude bits shifted into a float's exponent and mantissa fields read as
# ``|value| * 2**-p`` (E4M3's exponent bias is 7: float32's and bf16's 127, fp16's 15; E4M3
# subnormals land on the float's subnormals), so one exact multiplication by 2**p decodes every
# finite code: float32 by 2**120 (_BIAS_SHIFT), and the 16-bit floats: dtype -> (shift, 2**p).
_BIAS_SHIFT = 2.0**120
_SHORT_DECODE = {torch.bfloat16: (4, 2.0**120), torch.float16: (7, 2.0**8)}


def decode_magnitudes(
    codes: torch.Tensor, out: torch.Tensor | None = None, signed: bool = False
) -> torch.Tensor:
    """Finite float8_e4m3fn ``codes`` -> their magnitudes (or, ``signed``, values) in float32,
    in the storage of ``out`` (int32, the codes' shape): integer arithmetic instead of torch's
    float8 -> float conversion, which is ~20x slower."""
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.int32, device=codes.device)
    bits = out.copy_(codes.view(torch.uint8))
    sign = torch.bitwise_and(bits, _SIGN_BIT).bitwise_left_shift_(24) if signed else None
    bits.bitwise_and_(_MAGNITUDE_BITS).bitwise_left_shift_(20)
    if sign is not None:
        bits.bitwise_or_(sign)
    return bits.view(torch.float32).mul_(_BIAS_SHIFT)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in the scale's dtype (compressed-tensors' decompression): the codes decoded
    with integer arithmetic and multiplied in float32, where a 4-bit by 11-bit product is exact,
    then rounded once: bit-identical to ``q.to(dtype) * scale``, three times faster
    (tests/test_formats_spec.py)."""
    if q.dim() != 2 or scale.shape[0] not in (1, q.shape[0]):
        return q.to(scale.dtype) * scale
    out = torch.empty(q.shape, dtype=scale.dtype, device=q.device)
    n, k = q.shape
    bits = torch.empty((chunk_rows(n, k), k), dtype=torch.int32, device=q.device)
    for rows in row_chunks(n, k):
        codes = q[rows]
        nan = codes.view(torch.uint8).bitwise_and(_MAGNITUDE_BITS) == _MAGNITUDE_BITS
        values = decode_magnitudes(codes, bits[: rows.stop - rows.start], signed=True)
        values.mul_((scale[rows] if scale.shape[0] == n else scale).float())
        out[rows] = values.masked_fill_(nan, float("nan"))
    return out


FP8 = Format(
    name="fp8",
    block_size=0,
    bits_per_weight=8.0,
    scale_type="weight dtype, per row",
    layout="naive-quantized",
    weights_args=dict(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False),
    stored_dtypes={"weight": "F8_E4M3", "weight_scale": None},
    codes_per_byte=1,
    scales_checked="weight scales finite and positive",
    encode=lambda w, name, global_amax, energy: quantize(w, name, energy),
    decode=lambda stored, dtype: dequantize(stored["weight"], stored["weight_scale"]),
)
