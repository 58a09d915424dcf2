"""Heap hygiene as one context manager, :func:`heap_hygiene` (docs/eval-drift.md, "Memory":
why and what it saved).

A batch (or a range of one) runs inside ``heap_hygiene()``, which gives glibc's freed heap
pages back on exit; the FP32 reference pass inside ``heap_hygiene(reuse_freed=True)``, which
serves big blocks from the heap so that a freed one is reused.  A no-op on other C libraries.

>>> with heap_hygiene(reuse_freed=True):
...     for batch in batches:
...         with heap_hygiene():
...             draft(batch)
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from qstream.bounded.store import Ranges


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
    """Return every whole free page of the heap to the system (glibc's ``malloc_trim(0)``): what
    :func:`heap_hygiene` does on exit.  Costs milliseconds: per batch or range, not per op."""
    if _TRIM is not None:
        _TRIM(0)


@contextmanager
def heap_hygiene(reuse_freed: bool = False) -> Iterator[None]:
    """The heap hygiene of a batch, a range or a pass: on exit its freed memory goes back to the
    system (``trim_heap``).  With ``reuse_freed`` (around a whole pass, its batches each inside
    a plain one) glibc serves every allocation from the heap (no per-block mmap) and never
    trims on free, so a freed big block is reused by the next allocation of its size; on exit
    the thresholds are set where glibc's adaptive ones settle in a run that frees big blocks
    (``SETTLED``): once one is set by mallopt, glibc stops adapting them."""
    reuse = reuse_freed and _MALLOPT is not None
    if reuse:
        _MALLOPT(M_MMAP_MAX, 0)
        _MALLOPT(M_TRIM_THRESHOLD, 2**31 - 1)  # a C int: the largest
    try:
        yield
    finally:
        if reuse:
            for parameter, value in SETTLED.items():
                _MALLOPT(parameter, value)
        trim_heap()


class Trimmed:
    """``source``'s ranges, the heap trimmed after each: a long stream's many ranges, each
    leaving its small context latent between big temporaries, would otherwise keep ever more
    free holes resident (docs/context-sweep.md)."""

    def __init__(self, source: Ranges):
        self.shape, self._source = source.shape, source

    def rows(self, t0: int, t1: int) -> torch.Tensor:
        with heap_hygiene():
            return self._source.rows(t0, t1)
