"""Weight SNR (docs/formats.md): ``10 log10(sum w^2 / sum (w - w_hat)^2)`` in float64, from two
tensors or accumulated by a quantizer in an :class:`Energy` while each chunk is in cache.
"""

from __future__ import annotations

import math
import threading

import torch

# Squares are summed in float64 over slices of this many elements, whose float64 copy stays in
# the L2 cache (whole-chunk float64 temporaries cost twice as much).
F64_SLICE = 1 << 16
# Dtypes whose values differ exactly in float32 from their quantized values: both have at most
# 11 significant bits and, for every format here, w_hat is 0 or within a few binades of w, so
# w - w_hat needs fewer than float32's 24 bits (and its square fewer than float64's 53).
SHORT = (torch.bfloat16, torch.float16)

# Scratch buffers are kept per thread, not per Energy or call: a checkpoint run makes one Energy
# per piece, and fresh multi-MiB buffers each time cost more in page faults than the sums.
_scratch = threading.local()


def _buffer(name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    buf = getattr(_scratch, name, None)
    moved = buf is not None and (
        buf.device.type != device.type or device.index not in (None, buf.device.index)
    )
    if buf is None or buf.numel() < n or moved:
        buf = torch.empty(n, dtype=dtype, device=device)
        setattr(_scratch, name, buf)
    return buf[:n]


class Energy:
    """Running ``(sum w^2, sum (w - w_hat)^2)`` in float64 (Python floats: the same IEEE double
    additions as a float64 tensor, without its per-chunk ops)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.signal = self.noise = 0.0

    def add(self, w: torch.Tensor, x: torch.Tensor, w_hat: torch.Tensor, hat: torch.Tensor):
        """Add one chunk of rows ``w``: float32 ``x`` (``w``, or ``|w|``) and float32 ``w_hat``
        before dequantize rounds it to ``hat``'s dtype; ``x`` and ``w_hat`` are overwritten."""
        if hat.dtype in SHORT:
            return self.add_rounded(w, x, hat.copy_(w_hat), w_hat)
        error = _buffer("f64", x.numel(), torch.float64, self.device).view(x.shape)
        error.copy_(x).sub_(w_hat)
        flat = x.reshape(-1)
        signal = torch.zeros((), dtype=torch.float64, device=self.device)
        buf = _buffer("slice", min(F64_SLICE, flat.numel()), torch.float64, self.device)
        for start in range(0, flat.numel(), F64_SLICE):
            part = buf[: min(F64_SLICE, flat.numel() - start)].copy_(
                flat[start : start + F64_SLICE]
            )
            signal += torch.vdot(part, part)
        self.signal += signal.item()
        self.noise += torch.vdot(error.view(-1), error.view(-1)).item()

    def add_rounded(self, w: torch.Tensor, x: torch.Tensor, hat: torch.Tensor, error: torch.Tensor):
        """Add one chunk of rows ``w`` (a ``SHORT`` dtype): ``hat`` its dequantized values, ``x``
        in float32; the exact error ``hat - x`` goes through float32 ``error``."""
        noise = row_square_sums(_difference(hat, x, error))
        if noise is None:
            noise = _square_sum64(_difference(hat, x, error))
        signal = row_square_sums(x)
        self.noise += noise
        self.signal += _square_sum64(w) if signal is None else signal

    def sums(self) -> tuple[float, float]:
        return self.signal, self.noise


def _difference(hat: torch.Tensor, x: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """``hat - x`` into float32 ``error`` (faster than a mixed-dtype subtraction)."""
    if hat.dtype == error.dtype:
        return torch.sub(hat, x, out=error)
    return error.copy_(hat).sub_(x)


# Totals float32 row sums are trusted for: below, underflowed squares (< 2**-126 each) could
# weigh more than 2**-60 of the total; above, a square or a row sum may have overflowed.
FLOAT32_SAFE = (2.0**-60, 2.0**120)


def row_square_sums(t: torch.Tensor) -> float | None:
    """``sum t^2`` of a float32 chunk ``[rows, K]``, squared in place: float32 within each row
    (non-negative terms: a few ulps), float64 across rows (docs/formats.md).  None where the
    float32 sums overflow or underflow could matter: sum it with :func:`_square_sum64`."""
    total = t.mul_(t).sum(-1).sum(dtype=torch.float64).item()
    return total if FLOAT32_SAFE[0] <= total <= FLOAT32_SAFE[1] else None


def _square_sum64(t: torch.Tensor) -> float:
    return torch.linalg.vecdot(t.double(), t.double()).sum().item()


SNR_SLICE = 1 << 20


def snr_sums(w: torch.Tensor, w_hat: torch.Tensor) -> tuple[float, float]:
    """``(sum w^2, sum (w - w_hat)^2)`` in float64."""
    flat, flat_hat = w.reshape(-1), w_hat.reshape(-1)
    signal = noise = 0.0
    for start in range(0, flat.numel(), SNR_SLICE):
        part = flat[start : start + SNR_SLICE]
        x = _buffer("snr", part.numel(), torch.float64, w.device).copy_(part)
        signal += torch.dot(x, x).item()
        x.sub_(flat_hat[start : start + SNR_SLICE])
        noise += torch.dot(x, x).item()
    return signal, noise


def snr_db(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)``; inf when the error is zero, -inf for a zero signal."""
    if noise == 0.0:
        return float("inf")
    if signal == 0.0:
        return float("-inf")
    return 10.0 * math.log10(signal / noise)


def weight_snr_db(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return snr_db(*snr_sums(w, w_hat))
