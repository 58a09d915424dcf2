"""Weight SNR sums accumulated inside the quantizers (DESIGN.md section 3: ``10 log10(sum w^2 /
sum (w - w_hat)^2)`` in float64).

A quantizer that is given an :class:`Energy` adds each chunk's ``sum w^2`` and
``sum (w - w_hat)^2`` while the chunk is still in cache, with ``w_hat`` computed exactly as
``dequantize`` computes it, so the SNR is the one a second pass over the stored tensors would
give, without that pass.  ``tests/test_formats_properties.py`` checks the two against each other.
"""

from __future__ import annotations

import threading

import torch

# The float64 chunk buffer is kept per thread, not per Energy: a checkpoint run makes one Energy
# per piece, and a fresh multi-MiB buffer each time costs more in page faults than the sums.
_scratch = threading.local()


def _float64_scratch(n: int, device: torch.device) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n or buf.device.type != device.type:
        buf = _scratch.buf = torch.empty(n, dtype=torch.float64, device=device)
    return buf[:n]


class Energy:
    """Running ``(sum w^2, sum (w - w_hat)^2)`` in float64, on the weight's device."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._sums = torch.zeros(2, dtype=torch.float64, device=self.device)

    def add(self, w: torch.Tensor, w_hat: torch.Tensor) -> None:
        """Add one chunk: ``w`` the original values (any float dtype holding them exactly) and
        ``w_hat`` the dequantized ones, both rounded to the weight dtype already.  Differences
        are taken in float64, where they are exact, and squared and summed there."""
        x = _float64_scratch(w.numel(), self.device).view(w.shape).copy_(w)
        self._sums[0] += torch.vdot(x.view(-1), x.view(-1))
        x.sub_(w_hat)
        self._sums[1] += torch.vdot(x.view(-1), x.view(-1))

    def sums(self) -> tuple[float, float]:
        signal, noise = self._sums.tolist()
        return signal, noise
