"""What a weight format is (docs/formats.md): the spec constants, the :class:`Format` object
(code outside ``formats/`` asks it, never compares the name), and the checks and cache-sized row
chunking the quantizers share.  Spec sources: OCP Microscaling Formats (MX) v1.0; NVIDIA's NVFP4;
float8_e4m3fn.  The arithmetic follows compressed-tensors, which vLLM loads these with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from qstream.errors import QStreamError
from qstream.formats.snr import Energy
from qstream.units import FLOAT_DTYPE_NAMES, FLOAT_DTYPES

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest E2M1 magnitude
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of index 0..7

MXFP4_BLOCK = 32
MXFP4_E8M0_BIAS = 127
MXFP4_ELEM_EMAX = 2  # floor(log2(FP4_MAX)): the block amax maps into E2M1's top binade

NVFP4_BLOCK = 16
NVFP4_ZERO_BLOCK_SCALE = 0.125  # compressed-tensors' replacement for a zero FP8 block scale

Stored = dict[str, torch.Tensor]  # stored tensors of one weight, by suffix ("weight_scale", ...)
# (w, name, global_amax, energy) -> the stored tensors, in ``Format.stored`` order
Encode = Callable[[torch.Tensor, str, torch.Tensor | None, Energy | None], tuple]
Decode = Callable[[Stored, torch.dtype], torch.Tensor]  # (stored, dtype) -> weight
BadScales = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, str]]


def finite_positive(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Finite and positive (quantize never writes a zero scale)."""
    value = value.float()
    return value, ~(torch.isfinite(value) & (value > 0)), "non-finite or not positive"


@dataclass(frozen=True)
class Format:
    name: str
    block_size: int  # elements along K sharing one scale (0: one scale per row)
    bits_per_weight: float  # element bits plus scale bits amortised over the block
    scale_type: str
    layout: str  # compressed-tensors format string (quantization_config.format)
    weights_args: dict  # quantization_config.config_groups.group_0.weights
    # Stored tensor suffix -> its safetensors dtype (None: the weight's own float dtype), in
    # the order written: the codes, then the scales.
    stored_dtypes: dict[str, str | None]
    codes_per_byte: int  # elements in one byte of the codes
    scales_checked: str  # what verify's scale check requires of this format's scales
    encode: Encode
    decode: Decode
    bad_scales: BadScales = finite_positive  # (values as reported, mask of bad ones, why)
    # The per-tensor scale that a fused group's members share (vLLM keeps one per fused
    # layer, docs/vllm.md), written once per tensor; None when the format has none.
    global_scale: str | None = None

    @property
    def stored(self) -> tuple[str, ...]:
        return tuple(self.stored_dtypes)

    @property
    def scales(self) -> tuple[str, ...]:
        return self.stored[1:]

    def quantize(
        self,
        w: torch.Tensor,
        name: str = "weight",
        global_amax: torch.Tensor | None = None,
        energy: Energy | None = None,
    ) -> Stored:
        """One ``[N, K]`` weight -> the stored tensors by suffix; ``energy`` accumulates
        ``snr_sums(w, self.dequantize(stored))`` without that second pass."""
        if w.numel() == 0:
            raise ValueError(f"{name}: shape {list(w.shape)} has no elements; nothing to quantize")
        return dict(zip(self.stored, self.encode(w, name, global_amax, energy)))

    def dequantize(self, stored: Stored, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight: FP8 in its scale's dtype, the 4-bit formats in ``dtype``."""
        return self.decode(stored, dtype)

    def stored_shapes(self, n: int, k: int) -> dict[str, tuple[int, ...]]:
        per_row = k // self.block_size if self.block_size else 1
        shapes: dict[str, tuple[int, ...]] = {self.stored[0]: (n, k // self.codes_per_byte)}
        shapes[self.stored[1]] = (n, per_row)
        if self.global_scale:
            shapes[self.global_scale] = (1,)
        return shapes

    def accepted_dtypes(self, suffix: str) -> tuple[str, ...]:
        dtype = self.stored_dtypes[suffix]
        return FLOAT_DTYPE_NAMES if dtype is None else (dtype,)

    def marks_quantized(self, suffix: str, dtype: str) -> bool:
        """The codes show a module is quantized (plain ``weight`` only in its stored dtype)."""
        codes = self.stored[0]
        return suffix == codes and (codes != "weight" or dtype in self.accepted_dtypes(codes))


# Rows are processed in chunks of about this many elements (512 KiB of float32), so that the
# several elementwise passes over a chunk hit the CPU cache instead of memory.
CHUNK_ELEMENTS = 1 << 17


def check_weight(w: torch.Tensor, name: str, block: int = 1) -> None:
    if w.dtype not in FLOAT_DTYPES:
        raise QStreamError(f"{name}: dtype {w.dtype} is not bf16, fp16 or fp32")
    if w.ndim != 2:
        raise QStreamError(f"{name}: expected a 2-D [out, in] weight, got shape {tuple(w.shape)}")
    if w.shape[1] % block:
        raise QStreamError(
            f"{name}: shape {tuple(w.shape)} has K={w.shape[1]}, "
            f"not a multiple of the block size {block}"
        )


def check_finite(amax: torch.Tensor, name: str) -> None:
    if not torch.isfinite(amax).all():
        raise QStreamError(f"{name}: weight contains NaN or Inf")


_MAGNITUDE = {  # integer view and the mask that clears the sign bit
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
}


def block_abs_max(w: torch.Tensor, block: int):
    """``amax(|w|)`` over blocks of ``block`` along the last dim, in ``w.dtype`` (exact), on the
    integer view with the sign bit cleared (integer order is magnitude order; NaN sorts above
    Inf, so a NaN makes its block's result NaN)."""
    int_dtype, mask = _MAGNITUDE[w.dtype]
    magnitude = torch.bitwise_and(w.contiguous().view(int_dtype), mask)
    blocks = magnitude.view(*w.shape[:-1], w.shape[-1] // block, block)
    return blocks.amax(dim=-1).view(w.dtype)


def abs_max(w: torch.Tensor) -> torch.Tensor:
    """``amax(|w|)`` of a whole 2-D tensor, in ``w.dtype``, in cache-sized row chunks."""
    chunk_max = [block_abs_max(w[rows], w.shape[1]).amax() for rows in row_chunks(*w.shape)]
    return torch.stack(chunk_max).amax() if chunk_max else torch.zeros((), dtype=w.dtype)


def all_block_abs_max(w: torch.Tensor, block: int, name: str) -> torch.Tensor:
    """:func:`block_abs_max` of a 2-D weight ``[N, K/block]``, chunk by chunk, checked finite;
    on int32 (torch's CPU max over int16 is not vectorized)."""
    int_dtype, mask = _MAGNITUDE[w.dtype]
    n, k = w.shape
    bits = w.contiguous().view(int_dtype)
    out = torch.empty((n, k // block), dtype=torch.int32, device=w.device)
    scratch = torch.empty((chunk_rows(n, k), k), dtype=torch.int32, device=w.device)
    for rows in row_chunks(n, k):
        magnitude = scratch[: rows.stop - rows.start].copy_(bits[rows]).bitwise_and_(mask)
        torch.amax(magnitude.view(magnitude.shape[0], -1, block), -1, out=out[rows])
    amax = out.to(int_dtype).view(w.dtype)
    check_finite(amax, name)
    return amax


def chunk_rows(n_rows: int, row_elements: int) -> int:
    return max(1, min(n_rows, CHUNK_ELEMENTS // max(1, row_elements)))


def row_chunks(n_rows: int, row_elements: int) -> Iterator[slice]:
    step = chunk_rows(n_rows, row_elements)
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))


class ChunkWorkspace:
    """One chunk's buffers, allocated once per weight (fresh temporaries cost more in page faults
    than the arithmetic); with ``hat_dtype``, those of the weight SNR too."""

    def __init__(
        self, rows: int, k: int, device: torch.device, hat_dtype: torch.dtype | None = None
    ):
        self.x = torch.empty((rows, k), dtype=torch.float32, device=device)
        self.magnitude = torch.empty_like(self.x)
        self.scratch = torch.empty((rows, k), dtype=torch.int32, device=device)
        self.grid: torch.Tensor | None = None
        self.hat: torch.Tensor | None = None
        if hat_dtype is not None:
            self.grid = torch.empty_like(self.x)
            self.hat = (
                self.grid
                if hat_dtype == torch.float32
                else torch.empty((rows, k), dtype=hat_dtype, device=device)
            )

    def take(self, rows: slice):
        r = rows.stop - rows.start
        return self.x[:r], self.magnitude[:r], self.scratch[:r]

    def take_hat(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.grid is not None and self.hat is not None, "built without hat_dtype"
        r = rows.stop - rows.start
        return self.grid[:r], self.hat[:r]
