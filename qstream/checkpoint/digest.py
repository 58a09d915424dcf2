"""The sha256 of a file hashed while it is being written out of order.

:class:`~qstream.checkpoint.safetensors_io.ShardWriter` places tensors (and row ranges of them) at
their offsets as they are ready, not in file order.  A :class:`FollowingDigest` is told each
written range; a thread of its own hashes the file from the front as far as it is contiguously
written, reading those bytes back from the page cache.  Both the reads and the hashing release
the GIL, so with one quantizing worker the hash costs no wall time, and the finished file is not
read again at the end (docs/guarantees.md: the sha256 that quantize records).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

READ_BYTES = 8 << 20


class FollowingDigest:
    """sha256 of ``path`` (``size`` bytes), following the writes reported to :meth:`written`."""

    def __init__(self, path: Path, size: int):
        self._size = size
        self._fd = os.open(path, os.O_RDONLY)
        self._hash = hashlib.sha256()
        self._written: dict[int, int] = {}  # start -> end of written ranges not yet chained
        self._frontier = 0  # [0, frontier) is written
        self._stopped = False
        self._error: BaseException | None = None
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._follow, name="qstream-sha256", daemon=True)
        self._thread.start()

    def written(self, start: int, end: int) -> None:
        """Bytes ``[start, end)`` are in the file.  Every byte is reported exactly once."""
        with self._ready:
            self._written[start] = end
            advanced = False
            while self._frontier in self._written:
                self._frontier = self._written.pop(self._frontier)
                advanced = True
            if advanced:
                self._ready.notify()

    def hexdigest(self) -> str:
        """Wait for the hash of the whole file (every byte must have been reported)."""
        self._thread.join()
        os.close(self._fd)
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()

    def stop(self) -> None:
        """Abandon the hash (the write failed)."""
        with self._ready:
            self._stopped = True
            self._ready.notify()
        self._thread.join()
        os.close(self._fd)

    def _follow(self) -> None:
        hashed = 0
        try:
            while hashed < self._size:
                with self._ready:
                    while self._frontier <= hashed and not self._stopped:
                        self._ready.wait()
                    if self._stopped:
                        return
                    end = self._frontier
                while hashed < end:
                    data = os.pread(self._fd, min(READ_BYTES, end - hashed), hashed)
                    if not data:
                        raise OSError(f"unexpected end of file at byte {hashed}")
                    self._hash.update(data)
                    hashed += len(data)
        except BaseException as exc:  # reported by hexdigest
            self._error = exc
