"""The E2M1 (FP4) core shared by MXFP4 and NVFP4: rounding to 4-bit codes, nibble packing,
and decoding.  A code is ``sign << 3 | index`` with ``index`` into ``E2M1_GRID``; element 2j
of a row goes in the low nibble of byte j, element 2j+1 in the high nibble.

Rounding is float32 bit arithmetic (:func:`_codes32`), checked around every tie against
docs/formats.md's thresholds (tests/test_formats_spec.py, tests/e2m1_codes.py) and against
compressed-tensors (tests/test_formats_vs_compressed_tensors.py).
"""

from __future__ import annotations

import torch

from qstream.formats.format import (
    E2M1_GRID,
    FP4_MAX,
    ChunkWorkspace,
    Format,
    chunk_rows,
    row_chunks,
)
from qstream.formats.snr import Energy

# code -> value, including -0.0 for code 8 so that decoding keeps the sign bit
_DECODE = torch.tensor([*E2M1_GRID, *(-v for v in E2M1_GRID)], dtype=torch.float32)
_DECODE[8] = -0.0

_EXPONENT_MASK = 0x7F800000
_ONE_BITS = 0x3F800000  # float32 1.0: E2M1's smallest normal binade
_MAGIC_SHIFT = 22 << 23  # 2**22 times the binade: its ulp is the E2M1 step of that binade


def _codes32(
    magnitude: torch.Tensor,
    sign_source: torch.Tensor,
    scratch: torch.Tensor,
    grid: torch.Tensor | None = None,
) -> torch.Tensor:
    """int32 codes from float32 ``|y|`` (consumed: the codes are written over it) and a float32
    tensor with y's signs; ``scratch``: int32 of the same shape; ``grid``, if given, receives
    the rounded magnitudes.  In place: a fresh 1 MiB tensor per step costs more in page faults.

    1. Saturate at 6.
    2. Round half to even onto the E2M1 grid with one float addition: ``s = a + M`` where
       ``M = 2**(22 + e)`` and ``e = max(floor(log2 a), 0)``; the ulp of M is exactly the grid
       step of a's binade (0.5 below 2, 1 in [2, 4), 2 in [4, 6]), so the hardware's
       round-to-nearest-even performs the rounding, once, with no double rounding.
    3. ``bits(s) - bits(M)`` counts grid steps above zero in that binade (0..4, 2..4, 2..3),
       and adding ``2e`` turns the count into the E2M1 index.  (Integer arithmetic only: a
       float detour through subnormals costs ten times the rest of the encoding.)
    4. The sign bit comes from ``signbit`` of the input, so -0 and small negatives keep it.
    """
    a = magnitude.clamp_(max=FP4_MAX)
    magic = torch.bitwise_and(a.view(torch.int32), _EXPONENT_MASK, out=scratch)
    magic.clamp_(min=_ONE_BITS).add_(_MAGIC_SHIFT)
    a.add_(magic.view(torch.float32))
    if grid is not None:
        torch.sub(a, magic.view(torch.float32), out=grid)
    codes = a.view(torch.int32).sub_(magic)
    codes.add_(magic.sub_(_ONE_BITS + _MAGIC_SHIFT).bitwise_right_shift_(22))  # + 2e
    signs = torch.bitwise_right_shift(sign_source.view(torch.int32), 28, out=scratch)
    return codes.bitwise_or_(signs.bitwise_and_(8))


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """float32 ``y`` rounded half to even onto the signed E2M1 grid, saturating at 6."""
    magnitude, grid = y.abs(), torch.empty_like(y)
    _codes32(magnitude, y.contiguous(), torch.empty_like(y, dtype=torch.int32), grid)
    return grid.copysign_(y)


def _pack32(
    codes: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """int32 codes ``[..., K]`` (consumed) -> bytes ``out [..., K/2]``: narrowed to bytes, each
    little-endian int16 pair holds element 2j in its low byte; ``scratch``: a free int32 buffer
    of the codes' shape."""
    n = codes.numel()
    if scratch is None:
        scratch = torch.empty(n, dtype=torch.int32, device=codes.device)
    space = scratch.view(torch.uint8).view(-1)
    pairs = space[:n].view(codes.shape).copy_(codes).view(torch.int16)
    high = torch.bitwise_right_shift(
        pairs, 4, out=space[n : 2 * n].view(torch.int16).view(pairs.shape)
    )
    high.bitwise_and_(0xF0)
    return out.copy_(pairs.bitwise_and_(0x0F).bitwise_or_(high))


# byte -> (value of its low nibble, value of its high nibble): decoding packed bytes is one
# gather of pairs, with no unpacked code tensor in between.
_DECODE_PAIRS = torch.stack((_DECODE.repeat(16), _DECODE.repeat_interleave(16)), dim=-1)


def decode_packed(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed bytes ``[..., K/2]`` -> values ``[..., K]``."""
    table = _DECODE_PAIRS.to(device=packed.device, dtype=dtype)
    return torch.nn.functional.embedding(packed.long(), table).flatten(-2)


def dequantize_blocks(
    packed: torch.Tensor,
    step: torch.Tensor,
    block: int,
    dtype: torch.dtype,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Packed bytes ``[N, K/2]`` decoded in ``compute_dtype``, times one ``step`` per block
    (``[N, K/block]``), rounded to ``dtype``, in cache-sized row chunks."""
    n, k = packed.shape[0], packed.shape[1] * 2
    out = torch.empty((n, k), dtype=dtype, device=packed.device)
    for rows in row_chunks(n, k):
        r = rows.stop - rows.start
        values = decode_packed(packed[rows], compute_dtype).view(r, k // block, block)
        out[rows] = (values * step[rows].unsqueeze(-1)).view(r, k)
    return out


def encode_blocks(
    w: torch.Tensor,
    divisor: torch.Tensor,
    block: int,
    out: torch.Tensor,
    energy: Energy | None = None,
    inverse: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
    exact: bool = False,
) -> torch.Tensor:
    """The 4-bit quantizers' loop: ``w [N, K]`` with one float32 ``divisor`` per block
    (``[N, K/block, 1]``) -> packed E2M1 bytes in ``out [N, K/2]``: ``|w| / divisor`` as
    compressed-tensors divides, or ``|w| * inverse`` where exact.  ``energy`` gets the SNR sums
    with ``w_hat = +-E2M1 * step`` (``exact``: already a ``w.dtype`` value)."""
    n, k = w.shape
    step = divisor if step is None else step
    hat_dtype = None if energy is None else torch.float32 if exact else w.dtype
    work = ChunkWorkspace(chunk_rows(n, k), k, w.device, hat_dtype)
    for rows in row_chunks(n, k):
        x, magnitude, scratch = work.take(rows)
        x.copy_(w[rows])
        blocks = torch.abs(x, out=magnitude).view(-1, k // block, block)
        if inverse is None:
            blocks.div_(divisor[rows])
        else:
            blocks.mul_(inverse[rows])
        grid, hat = (None, None) if energy is None else work.take_hat(rows)
        _pack32(_codes32(magnitude, x, scratch, grid), out[rows], scratch)
        if energy is not None and grid is not None and hat is not None:
            # magnitudes: w_hat has w's sign (or is 0), so (w - w_hat)^2 = (|w| - |w_hat|)^2
            grid.view(-1, k // block, block).mul_(step[rows])
            if exact:  # the packed codes left scratch free for the error
                energy.add_rounded(w[rows], x.abs_(), grid, scratch.view(torch.float32))
            else:
                energy.add(w[rows], x.abs_(), grid, hat)
    return out


_SCALE_DTYPES = {"U8": "torch.uint8", "F8_E4M3": "torch.float8_e4m3fn"}  # safetensors -> config


def fp4_format(name: str, block: int, strategy: str, scale: str, **facts) -> Format:
    """A 4-bit :class:`Format`: two E2M1 codes per byte, one ``scale`` per ``block`` along K."""
    stored: dict[str, str | None] = {"weight_packed": "U8", "weight_scale": scale}
    if facts.get("global_scale"):
        stored[facts["global_scale"]] = "F32"
    return Format(
        name=name,
        block_size=block,
        bits_per_weight=4 + 8 / block,
        layout=f"{name}-pack-quantized",
        weights_args=dict(
            num_bits=4,
            type="float",
            strategy=strategy,
            group_size=block,
            symmetric=True,
            dynamic=False,
            scale_dtype=_SCALE_DTYPES[scale],
        ),
        stored_dtypes=stored,
        codes_per_byte=2,
        **facts,
    )
