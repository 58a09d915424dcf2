"""Giving freed heap memory back to the operating system (docs/eval-drift.md, "Memory").

glibc's malloc serves allocations under its mmap threshold (which rises to 32 MiB as big blocks
are freed) from the heap, and returns only the heap's free top to the system.  eval-drift at K3
scale frees and allocates such tensors every batch (per-position logits over a 163,840-token
vocabulary, context latents, GEMM outputs), and the free holes between longer-lived ones stayed
resident: 4 GB of a 13.4 GB peak, of which ``malloc_trim(0)`` released 2.7 GB at once.
"""

from __future__ import annotations

import ctypes
import sys


def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim()


def trim_heap() -> None:
    """Return every whole free page of the heap to the system (glibc's ``malloc_trim(0)``; a
    no-op on other C libraries).  Costs milliseconds; call it between batches, not per op."""
    if _TRIM is not None:
        _TRIM(0)
