"""Giving freed heap memory back to the operating system (docs/eval-drift.md, "Memory").

glibc's malloc serves allocations under its mmap threshold (which rises to 32 MiB as big blocks
are freed) from the heap, and returns only the heap's free top to the system.  eval-drift at K3
scale frees and allocates such tensors every batch (per-position logits over a 163,840-token
vocabulary, context latents, GEMM outputs), and the free holes between longer-lived ones stayed
resident: 4 GB of a 13.4 GB peak, of which ``malloc_trim(0)`` released 2.7 GB at once.

Blocks above the mmap threshold are mapped at each allocation and unmapped at each free, so
every big temporary is faulted in again page by page: a 1024-block K3 evaluation took 158 M
page faults.  :func:`reuse_freed_blocks` serves them from the heap instead, where a freed block
is reused by the next allocation of its size within the batch, and ``trim_heap`` gives the
pages back at the batch's end.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def _glibc(name: str):
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM, _MALLOPT = _glibc("malloc_trim"), _glibc("mallopt")
# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
# Where glibc's adaptive thresholds settle once big blocks have been freed (the mmap threshold
# rises to at most 32 MiB, the trim threshold to twice it); mallopt fixes them there on exit.
SETTLED = {M_MMAP_MAX: 65536, M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 64 << 20}


def trim_heap() -> None:
    """Return every whole free page of the heap to the system (glibc's ``malloc_trim(0)``; a
    no-op on other C libraries).  Costs milliseconds; call it between batches, not per op."""
    if _TRIM is not None:
        _TRIM(0)


@contextmanager
def reuse_freed_blocks() -> Iterator[None]:
    """Within the block, glibc serves every allocation from the heap (no per-block mmap) and
    never trims on free; call ``trim_heap`` between batches.  At K3 a reference batch ran 3-5%
    faster with half the system time.  On exit the thresholds are set where glibc's adaptive
    ones settle in a run that frees big blocks (``SETTLED``): once one is set by mallopt, glibc
    stops adapting them."""
    if _MALLOPT is None:
        yield
        return
    _MALLOPT(M_MMAP_MAX, 0)
    _MALLOPT(M_TRIM_THRESHOLD, 2**31 - 1)  # a C int: the largest
    try:
        yield
    finally:
        for parameter, value in SETTLED.items():
            _MALLOPT(parameter, value)
        trim_heap()
