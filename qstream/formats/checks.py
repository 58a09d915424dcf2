"""Input checks shared by the three formats, and cache-sized row chunking."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from qstream.errors import QStreamError
from qstream.formats.spec import SUPPORTED_DTYPES

# Rows are processed in chunks of about this many elements (512 KiB of float32), so that the
# several elementwise passes over a chunk hit the CPU cache instead of memory.
CHUNK_ELEMENTS = 1 << 17


def check_weight(w: torch.Tensor, name: str, block: int = 1) -> None:
    """A 2-D ``[N_out, K_in]`` float weight whose K splits into blocks along the row."""
    if w.dtype not in SUPPORTED_DTYPES:
        raise QStreamError(f"{name}: dtype {w.dtype} is not bf16, fp16 or fp32")
    if w.ndim != 2:
        raise QStreamError(f"{name}: expected a 2-D [out, in] weight, got shape {tuple(w.shape)}")
    if w.shape[1] % block:
        raise QStreamError(
            f"{name}: shape {tuple(w.shape)} has K={w.shape[1]}, "
            f"not a multiple of the block size {block}"
        )


def check_finite(amax: torch.Tensor, name: str) -> None:
    """``amax`` reductions propagate NaN and Inf, so checking them checks every element."""
    if not torch.isfinite(amax).all():
        raise QStreamError(f"{name}: weight contains NaN or Inf")


_MAGNITUDE = {  # integer view and the mask that clears the sign bit
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
}


def block_abs_max(w: torch.Tensor, block: int) -> torch.Tensor:
    """``amax(|w|)`` over consecutive blocks of ``block`` elements along the last dim, in
    ``w.dtype`` (exact).  Computed on the integer view with the sign bit cleared, where the
    order of magnitudes is the order of integers: one cheap pass, no float temporary.
    NaN sorts above Inf, so a NaN anywhere in a block makes that block's result NaN."""
    int_dtype, mask = _MAGNITUDE[w.dtype]
    magnitude = w.contiguous().view(int_dtype) & mask
    blocks = magnitude.view(*w.shape[:-1], w.shape[-1] // block, block)
    return blocks.amax(dim=-1).view(w.dtype)


def abs_max(w: torch.Tensor) -> torch.Tensor:
    """``amax(|w|)`` of a whole 2-D tensor, in ``w.dtype``, in cache-sized row chunks."""
    chunk_max = [block_abs_max(w[rows], w.shape[1]).amax() for rows in row_chunks(*w.shape)]
    return torch.stack(chunk_max).amax() if chunk_max else torch.zeros((), dtype=w.dtype)


def all_block_abs_max(w: torch.Tensor, block: int, name: str) -> torch.Tensor:
    """:func:`block_abs_max` of a whole 2-D weight ``[N, K/block]``, filled chunk by chunk,
    after checking that no element is NaN or Inf (the error names the tensor)."""
    out = torch.empty((w.shape[0], w.shape[1] // block), dtype=w.dtype, device=w.device)
    for rows in row_chunks(*w.shape):
        out[rows] = block_abs_max(w[rows], block)
    check_finite(out, name)
    return out


def chunk_rows(n_rows: int, row_elements: int) -> int:
    """Rows per chunk of :func:`row_chunks` (for sizing reusable buffers)."""
    return max(1, min(n_rows, CHUNK_ELEMENTS // max(1, row_elements)))


def row_chunks(n_rows: int, row_elements: int) -> Iterator[slice]:
    step = chunk_rows(n_rows, row_elements)
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))


class ChunkWorkspace:
    """float32 copy, magnitude and int32 scratch buffers for one chunk of rows, allocated once
    per weight and reused by every chunk of the 4-bit quantizers: a fresh 1 MiB temporary per
    step costs more in page faults than the arithmetic does.  With ``hat_dtype`` it also holds
    the rounded E2M1 values and the dequantized chunk in that dtype, for the weight SNR."""

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
