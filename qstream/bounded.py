"""Bounded memory (docs/eval-drift.md, "Memory"); knows nothing of models, regimes or metrics.

A :class:`Store` holds tensors by key: in memory while they fit under its budget, the rest in an
unlinked scratch file read and written with positional I/O (no mmap: the pages stay in the
kernel's page cache, never in the resident set), bit-exactly either way; :class:`Recorded` keeps
the ranges a consumer takes of a tensor too big to hold.  :func:`heap_hygiene` gives glibc's
freed heap pages back after a batch, or around the FP32 reference pass serves big blocks from the
heap so that a freed one is reused (a no-op on other C libraries)."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import tempfile
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from qstream.errors import QStreamError

# A store told its total stays in memory up to this size (per-block logits: the tiny draft's
# whole evaluation, the small draft's up to ~600 blocks); a bigger one goes to the scratch file.
MEMORY_BYTES = 512 << 20

_Spilled = tuple[int, torch.Size, torch.dtype]  # offset in the scratch file, shape, dtype


class Store:
    """Tensors by key.  Without ``total_bytes`` a put stays in memory while the held total stays
    within ``memory_bytes`` (default ``MEMORY_BYTES``), and goes to the scratch file beyond it,
    or with ``spill`` False is not kept (a cache whose caller makes it again).  With
    ``total_bytes`` (what the caller will put, when it knows) everything stays in memory if that
    fits, else everything goes to disk, whose free space is checked now.  Close it (or use it as
    a context manager) to free its memory and file."""

    def __init__(
        self,
        scratch_dir: str | None = None,
        *,
        memory_bytes: int | None = None,
        total_bytes: int | None = None,
        spill: bool = True,
    ):
        self.scratch_dir = scratch_dir or tempfile.gettempdir()
        self.memory_bytes = MEMORY_BYTES if memory_bytes is None else memory_bytes
        self.total_bytes, self.spill = total_bytes, spill
        self._items: dict[Hashable, torch.Tensor | _Spilled] = {}
        self.held_bytes = self.end = 0
        self.fd: int | None = None
        if total_bytes is not None and total_bytes > self.memory_bytes:
            self.memory_bytes = 0
            self.fd = _scratch_file(self.scratch_dir, total_bytes)

    def put(self, key: Hashable, tensor: torch.Tensor) -> bool:
        """Keep ``tensor`` under ``key``; whether it was kept (only a non-spilling store drops)."""
        tensor = tensor.detach().cpu().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if self.held_bytes + nbytes <= self.memory_bytes:
            if tensor.untyped_storage().nbytes() > nbytes:  # a view: hold its elements only
                tensor = tensor.clone()
            self._items[key] = tensor
            self.held_bytes += nbytes
            return True
        if not self.spill:
            return False
        data = tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")
        if self.fd is None:
            self.fd = _scratch_file(self.scratch_dir, len(data))
        offset = self.end
        try:
            while data:  # pwrite may write less than asked
                written = os.pwrite(self.fd, data, offset)
                data, offset = data[written:], offset + written
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):  # the disk filled while running
                raise
            if self.total_bytes is not None:
                what = f"{self.total_bytes} bytes needed"
            else:
                what = f"{self.end + nbytes} bytes written"
            raise QStreamError(
                f"--scratch-dir {self.scratch_dir}: no space left for the per-block outputs "
                f"({what})"
            ) from e
        self._items[key] = (self.end, tensor.shape, tensor.dtype)
        self.end = offset
        return True

    def get(self, key: Hashable) -> torch.Tensor:
        """The tensor put under ``key`` (held in memory: that tensor itself, not to be changed)."""
        item = self._items[key]
        if isinstance(item, torch.Tensor):
            return item
        offset, shape, dtype = item
        out = torch.empty(shape, dtype=dtype)
        data = out.reshape(-1).view(torch.uint8).numpy().data.cast("B")
        assert self.fd is not None
        while data:  # preadv may read less than asked
            read = os.preadv(self.fd, [data], offset)
            if read == 0:
                raise RuntimeError(f"scratch file: bytes at {offset} were never written")
            data, offset = data[read:], offset + read
        return out

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def close(self) -> None:
        self._items.clear()
        self.held_bytes = 0
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Ranges(Protocol):
    """A tensor [S, T, W] too big to hold, produced a range of positions (dim 1) at a time."""

    shape: tuple[int, int, int]

    def rows(self, t0: int, t1: int) -> torch.Tensor:
        """Positions t0..t1-1: [S, t1 - t0, W]."""
        ...


class Recorded:
    """``source``'s ranges put in ``store`` as a consumer takes them, in order from 0 to T; once
    all are taken (``complete``) the source is dropped, and ``rows`` reads the same bits back by
    any range."""

    def __init__(self, source: Ranges, store: Store):
        self.shape, self._store = source.shape, store
        self._source: Ranges | None = source
        self._pieces: list[tuple[int, int]] = []

    @property
    def complete(self) -> bool:
        return bool(self._pieces) and self._pieces[-1][1] == self.shape[1]

    def rows(self, t0: int, t1: int) -> torch.Tensor:
        if self._source is not None:
            rows = self._source.rows(t0, t1).cpu()
            self._store.put((self, t0, t1), rows)
            self._pieces.append((t0, t1))
            if self.complete:
                self._source = None
            return rows
        parts = [
            self._store.get((self, a, b))[:, max(a, t0) - a : min(b, t1) - a]
            for a, b in self._pieces
            if a < t1 and b > t0
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _scratch_file(directory: str, nbytes: int) -> int:
    """A descriptor of a new temporary file in ``directory`` that has no name (unlinked as it
    is created), so nothing is left behind whatever happens; ``nbytes`` must fit."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError as e:
        raise QStreamError(f"--scratch-dir {directory}: {e.strerror or e}") from e
    if free < nbytes:
        raise QStreamError(
            f"--scratch-dir {directory}: {nbytes} bytes needed for the per-block outputs, "
            f"{free} free (pass --scratch-dir on a bigger disk, or fewer --blocks)"
        )
    with tempfile.TemporaryFile(prefix="qstream-blocks-", dir=directory) as f:
        return os.dup(f.fileno())


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
    """On exit, freed memory goes back to the system (``trim_heap``).  With ``reuse_freed``
    (around a whole pass) glibc serves every allocation from the heap and never trims on free,
    so a freed big block is reused; on exit the thresholds are fixed at ``SETTLED``."""
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
    """``source``'s ranges, the heap trimmed after each (else a long stream's many ranges keep
    ever more free holes resident: docs/context-sweep.md)."""

    def __init__(self, source: Ranges):
        self.shape, self._source = source.shape, source

    def rows(self, t0: int, t1: int) -> torch.Tensor:
        with heap_hygiene():
            return self._source.rows(t0, t1)
