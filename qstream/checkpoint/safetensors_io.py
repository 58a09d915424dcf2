"""safetensors files read and written one tensor (or one row range) at a time.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length
``n``, ``n`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}``, then the data section; offsets are relative to its start.

Headers are parsed strictly: every malformed file is a :class:`QStreamError` naming the file and
tensor.  :class:`ShardWriter` can hash a file as it writes it (docs/guarantees.md: the sha256 that
quantize records), so the finished file is not read again.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import struct
import threading
import weakref
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

from qstream.errors import QStreamError

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

# The safetensors reference implementation refuses headers above 100 MB (MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000
_PAGE = mmap.PAGESIZE
# madvise(2) advice, Linux >= 5.14, which not every Python's mmap module names (value from
# include/uapi/asm-generic/mman-common.h).
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def row_bytes(self) -> int:
        """Bytes per index of the first dimension (the whole tensor for a 0-d one)."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    tensors: dict[str, TensorInfo]  # in data order
    metadata: dict[str, str] | None
    data_offset: int  # 8 + header length: where the data section starts in the file
    file_size: int


def read_header(path: str | os.PathLike) -> ShardHeader:
    """Parse and validate the header of one safetensors file (the data is not read)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise QStreamError(f"{path}: truncated safetensors file ({file_size} bytes)")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise QStreamError(
                    f"{path}: safetensors header of {length} bytes is over the "
                    f"{MAX_HEADER_BYTES}-byte limit (corrupt file?)"
                )
            if 8 + length > file_size:
                raise QStreamError(
                    f"{path}: truncated safetensors file (header says {length} "
                    f"bytes, file has {file_size})"
                )
            raw = f.read(length)
    except OSError as exc:
        raise QStreamError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QStreamError(f"{path}: corrupt safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise QStreamError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise QStreamError(f"{path}: __metadata__ must map strings to strings")
    data_size = file_size - 8 - length
    tensors = [_tensor_info(path, name, entry, data_size) for name, entry in header.items()]
    tensors.sort(key=lambda t: (t.begin, t.end))
    _check_layout(path, tensors, data_size)
    return ShardHeader(path, {t.name: t for t in tensors}, metadata, 8 + length, file_size)


def _check_layout(path: Path, tensors: list[TensorInfo], data_size: int) -> None:
    """Tensors must tile the data section exactly, as the reference implementation requires."""
    position, previous = 0, None
    for t in tensors:
        if t.begin < position:
            raise QStreamError(
                f"{path}: tensor {t.name!r} overlaps tensor {previous!r} "
                f"(offset {t.begin} < {position})"
            )
        if t.begin > position:
            raise QStreamError(
                f"{path}: {t.begin - position} unaccounted bytes before tensor "
                f"{t.name!r} at offset {position}"
            )
        position, previous = t.end, t.name
    if position != data_size:
        raise QStreamError(
            f"{path}: {data_size - position} bytes after the last tensor "
            "(corrupt or mis-sized file)"
        )


def _tensor_info(path: Path, name: str, entry, data_size: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise QStreamError(f"{where}: entry must have exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise QStreamError(f"{where}: unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise QStreamError(f"{where}: bad shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise QStreamError(f"{where}: bad data_offsets {offsets!r}")
    begin, end = offsets
    if end > data_size:
        raise QStreamError(
            f"{where}: data_offsets {offsets} run past the end of the data "
            f"({data_size} bytes; truncated file?)"
        )
    expected = prod(shape) * DTYPES[dtype].itemsize
    if end - begin != expected:
        raise QStreamError(
            f"{where}: data_offsets {offsets} span {end - begin} bytes but "
            f"{dtype} {shape} needs {expected}"
        )
    return TensorInfo(name, dtype, tuple(shape), begin, end)


# Every mapping a ShardReader opened that is still alive (a tensor viewing it keeps it alive),
# with its base address.
_LIVE_MAPS: weakref.WeakKeyDictionary[mmap.mmap, int] = weakref.WeakKeyDictionary()


def drop_resident_pages(tensor: torch.Tensor | None = None) -> None:
    """Drop mapped checkpoint pages from the resident set (MADV_DONTNEED): those under ``tensor``
    when it views a live mapping, or every live mapping's (``tensor`` None).  A page touched again
    is mapped back unchanged from the page cache (docs/eval-drift.md, "Memory")."""
    for mapping, base in list(_LIVE_MAPS.items()):
        if mapping.closed:
            continue
        if tensor is None:
            mapping.madvise(mmap.MADV_DONTNEED)
            continue
        start = tensor.data_ptr() - base
        if 0 <= start < len(mapping):
            end = start + tensor.numel() * tensor.element_size()
            begin, stop = _pages(start, end, len(mapping))
            mapping.madvise(mmap.MADV_DONTNEED, begin, stop - begin)
            return


def _pages(begin: int, end: int, size: int) -> tuple[int, int]:
    return begin // _PAGE * _PAGE, min(-(-end // _PAGE) * _PAGE, size)


class ShardReader:
    """Memory-mapped, read-only access to the tensors of one file."""

    def __init__(self, header: ShardHeader):
        self.header = header
        with open(header.path, "rb") as f:
            # ACCESS_COPY (a private mapping) gives torch a writable buffer without any
            # possibility of writing to the input file.
            self._map = (
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if header.file_size else None
            )
        if self._map is not None:
            _LIVE_MAPS[self._map] = ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def _span(self, name: str, rows: slice | None) -> tuple[int, int]:
        info = self.header.tensors[name]
        if rows is None:
            return info.begin, info.end
        return info.begin + rows.start * info.row_bytes, info.begin + rows.stop * info.row_bytes

    def tensor(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """The tensor (or rows ``rows`` of its first dimension), a view of the mapped file."""
        info = self.header.tensors[name]
        begin, end = self._span(name, rows)
        shape = info.shape if rows is None else (rows.stop - rows.start, *info.shape[1:])
        if end == begin:
            return torch.empty(shape, dtype=info.torch_dtype)
        flat = torch.frombuffer(
            self._map, dtype=torch.uint8, count=end - begin, offset=self.header.data_offset + begin
        )
        return flat.view(info.torch_dtype).reshape(shape)

    def raw(self, name: str, begin: int, end: int) -> memoryview:
        """Bytes ``begin:end`` of the tensor's data (for byte-exact copies)."""
        start = self.header.data_offset + self.header.tensors[name].begin
        assert self._map is not None  # a tensor with bytes implies a non-empty file
        return memoryview(self._map)[start + begin : start + end]

    def prefetch(self, name: str, rows: slice | None = None) -> None:
        """Map a range's pages ahead of use, so that the thread computing on them does not stop
        for page faults; a kernel without MADV_POPULATE_READ (Linux < 5.14) faults them in."""
        try:
            self._advise(name, rows, _MADV_POPULATE_READ)
        except OSError:  # EINVAL: not supported here; the pages are read on first use
            pass

    def release(self, name: str, rows: slice | None = None) -> None:
        """Drop the pages of a range already processed from this process's resident memory."""
        self._advise(name, rows, mmap.MADV_DONTNEED)

    def _advise(self, name: str, rows: slice | None, advice: int) -> None:
        if self._map is None:
            return
        begin, end = self._span(name, rows)
        offset = self.header.data_offset
        begin, end = _pages(offset + begin, offset + end, len(self._map))
        if end > begin:
            self._map.madvise(advice, begin, end - begin)


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]


def header_bytes(
    tensors: list[PlannedTensor], metadata: dict[str, str] | None
) -> tuple[bytes, dict]:
    """The serialized header (padded with spaces to a multiple of 8, as safetensors does) and
    ``{name: TensorInfo}`` of the layout it describes."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    infos, position = {}, 0
    for t in tensors:
        end = position + prod(t.shape) * DTYPES[t.dtype].itemsize
        infos[t.name] = TensorInfo(t.name, t.dtype, t.shape, position, end)
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [position, end]}
        position = end
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return raw, infos


def serialize(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A whole safetensors file in memory, the same bytes in every process (safetensors' own
    ``save`` orders the metadata keys by a hash map seeded per process)."""
    planned = [PlannedTensor(k, DTYPE_NAMES[v.dtype], tuple(v.shape)) for k, v in tensors.items()]
    raw, _ = header_bytes(planned, dict(sorted(metadata.items())))
    return (
        struct.pack("<Q", len(raw)) + raw + b"".join(_bytes(v).tobytes() for v in tensors.values())
    )


def _bytes(tensor: torch.Tensor):
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def planned_file_size(tensors: list[PlannedTensor], metadata: dict[str, str] | None) -> int:
    raw, infos = header_bytes(tensors, metadata)
    return 8 + len(raw) + sum(i.nbytes for i in infos.values())


class ShardWriter:
    """A safetensors file written in place: header first, then any tensor or row range of a
    tensor at its offset, from any thread (``os.pwrite``)."""

    def __init__(
        self,
        path: Path,
        tensors: list[PlannedTensor],
        metadata: dict[str, str] | None = None,
        digest: bool = False,
    ):
        self.path = path
        raw, self.infos = header_bytes(tensors, metadata)
        self.data_offset = 8 + len(raw)
        self._written = dict.fromkeys(self.infos, 0)
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self._fd, struct.pack("<Q", len(raw)) + raw)
        size = self.data_offset + sum(i.nbytes for i in self.infos.values())
        os.ftruncate(self._fd, size)
        self._digest = FollowingDigest(path, size) if digest else None
        if self._digest is not None:
            self._digest.written(0, self.data_offset)

    def write(self, name: str, data: torch.Tensor | memoryview, row_start: int = 0) -> None:
        """Write ``data`` (a tensor of the planned dtype, or raw bytes) into tensor ``name``
        starting at index ``row_start`` of its first dimension."""
        info = self.infos[name]
        if isinstance(data, torch.Tensor):
            if data.dtype != info.torch_dtype:
                raise ValueError(f"{name}: writing {data.dtype} into a {info.dtype} tensor")
            data = memoryview(_bytes(data))
        offset = row_start * info.row_bytes
        if offset + len(data) > info.nbytes:
            raise ValueError(
                f"{name}: write of {len(data)} bytes at {offset} overruns {info.nbytes}"
            )
        position = self.data_offset + info.begin + offset
        while len(data):
            done = os.pwrite(self._fd, data, position)
            if self._digest is not None:
                self._digest.written(position, position + done)
            data, position = data[done:], position + done
            with self._lock:
                self._written[name] += done

    def close(self) -> str | None:
        """Close the file; every planned byte must have been written exactly once.  Returns the
        file's sha256 when the writer was made with ``digest``."""
        missing = [n for n, i in self.infos.items() if self._written[n] != i.nbytes]
        if missing:
            self.abort()
            raise RuntimeError(f"{self.path}: tensors not completely written: {missing[:5]}")
        os.close(self._fd)
        return None if self._digest is None else self._digest.hexdigest()

    def abort(self) -> None:
        os.close(self._fd)
        if self._digest is not None:
            self._digest.stop()


READ_BYTES = 8 << 20  # read back per step by FollowingDigest's thread


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
            while self._frontier in self._written:
                self._frontier = self._written.pop(self._frontier)
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
