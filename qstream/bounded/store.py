"""Per-block float32 outputs kept for one regime, in bounded memory (docs/eval-drift.md, "Memory").

The FP32 reference's teacher-forced logits and its U are ``[N, B, V]`` float32, kept from the
reference pass until every variant has been compared: 4.7 GiB each at K3's 163,840-token
vocabulary and 1024 blocks.  A :class:`BlockStore` holds such an array in memory when it is
small (at most ``MEMORY_BYTES``) and otherwise in an unlinked temporary file in a scratch
directory, written and read with positional file I/O (no mmap: the pages sit in the kernel's
page cache, which it may write back and drop, never in the process's resident set).  Rows
round-trip bit-exactly either way.

>>> with BlockStore((N, B, V), scratch_dir=None) as store:
...     store[batch.blocks] = logits            # [n, B, V] rows, any order
...     store[batch.blocks]                     # a new [n, B, V] tensor
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from qstream.errors import QStreamError

# Stores up to this size stay in memory, exactly as before: the tiny draft's whole evaluation
# and the small draft's up to ~550 blocks.  Bigger ones go to the scratch directory.
MEMORY_BYTES = 512 << 20


class BlockStore:
    """A ``[N, *row]`` float32 array read and written by row index tensors (module docstring).
    Close it (or use it as a context manager) to free its memory or file."""

    def __init__(
        self,
        shape: tuple[int, ...],
        *,
        scratch_dir: str | None = None,
        memory_bytes: int | None = None,
    ):
        self.shape = shape
        self.row_shape = shape[1:]
        self.row_bytes = 4 * _product(self.row_shape)
        nbytes = shape[0] * self.row_bytes
        limit = MEMORY_BYTES if memory_bytes is None else memory_bytes
        self.memory: torch.Tensor | None = None
        self.fd: int | None = None
        if nbytes <= limit:
            self.memory = torch.empty(shape)
        else:
            self.fd = _scratch_file(scratch_dir or tempfile.gettempdir(), nbytes)
        self.scratch_dir = scratch_dir or tempfile.gettempdir()

    @property
    def on_disk(self) -> bool:
        return self.fd is not None

    def __setitem__(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        rows = rows.detach().to("cpu", torch.float32).contiguous()
        if self.memory is not None:
            self.memory[idx] = rows
            return
        for start, stop, first in self._runs(idx):
            data = rows[start:stop].numpy().data.cast("B")
            self._io(_write_all, data, first * self.row_bytes)

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        if self.memory is not None:
            return self.memory[idx]
        out = torch.empty(len(idx), *self.row_shape)
        for start, stop, first in self._runs(idx):
            data = out[start:stop].numpy().data.cast("B")
            _read_all(self.fd, data, first * self.row_bytes)
        return out

    def _runs(self, idx: torch.Tensor) -> Iterator[tuple[int, int, int]]:
        """(start, stop, first row) for each run of consecutive row numbers in ``idx``: one
        system call per run."""
        rows = [int(i) for i in torch.as_tensor(idx).reshape(-1)]
        for i in rows:
            if not 0 <= i < self.shape[0]:
                raise IndexError(f"block store: row {i} outside 0..{self.shape[0] - 1}")
        start = 0
        for j in range(1, len(rows) + 1):
            if j == len(rows) or rows[j] != rows[j - 1] + 1:
                yield start, j, rows[start]
                start = j

    def _io(
        self, call: Callable[[int, memoryview, int], None], data: memoryview, offset: int
    ) -> None:
        assert self.fd is not None
        with _disk_full_is_an_error(
            self.scratch_dir, f"{self.shape[0] * self.row_bytes} bytes needed"
        ):
            call(self.fd, data, offset)

    def close(self) -> None:
        self.memory = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _product(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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


class SpillFile:
    """Tensors of any shape and dtype written once and read back by handle, in an unlinked
    scratch file created at the first write (positional I/O as :class:`BlockStore`'s): what
    a cache holds beyond its memory cap (the boot regime's aux states)."""

    def __init__(self, scratch_dir: str | None = None):
        self.scratch_dir = scratch_dir or tempfile.gettempdir()
        self.fd: int | None = None
        self.end = 0

    def put(self, tensor: torch.Tensor) -> tuple[int, torch.Size, torch.dtype]:
        tensor = tensor.detach().cpu().contiguous()
        data = tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")
        if self.fd is None:
            self.fd = _scratch_file(self.scratch_dir, len(data))
        with _disk_full_is_an_error(self.scratch_dir, f"{self.end + len(data)} bytes written"):
            _write_all(self.fd, data, self.end)
        handle = (self.end, tensor.shape, tensor.dtype)
        self.end += len(data)
        return handle

    def get(self, handle: tuple[int, torch.Size, torch.dtype]) -> torch.Tensor:
        offset, shape, dtype = handle
        assert self.fd is not None, "nothing was written"
        out = torch.empty(shape, dtype=dtype)
        _read_all(self.fd, out.reshape(-1).view(torch.uint8).numpy().data.cast("B"), offset)
        return out

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:  # pwrite may write less than asked
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _read_all(fd: int | None, data: memoryview, offset: int) -> None:
    assert fd is not None
    while data:  # preadv may read less than asked
        read = os.preadv(fd, [data], offset)
        if read == 0:
            raise RuntimeError(f"scratch file: bytes at {offset} were never written")
        data, offset = data[read:], offset + read


@contextmanager
def _disk_full_is_an_error(directory: str, what: str) -> Iterator[None]:
    """ENOSPC / EDQUOT while writing a scratch file: one QStreamError line naming the directory."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):  # the disk filled while running
            raise QStreamError(
                f"--scratch-dir {directory}: no space left for the per-block outputs ({what})"
            ) from e
        raise
