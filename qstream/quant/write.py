"""What a quantize run writes (docs/quantize.md, "What is written"; docs/guarantees.md): the
:class:`Plan` (every output header laid out first), the NVFP4 global-amax pre-pass, and the input
cut into pieces (row ranges of one tensor) streamed through a bounded thread pool: memory is
bounded by the ``2 * workers`` pieces in flight, never by a tensor, a shard or the model.
"""

from __future__ import annotations

import shutil
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from qstream.checkpoint.files import CONFIG_NAME, INDEX_NAME, Checkpoint, file_digests
from qstream.checkpoint.layout import quantization_config, stored_tensors
from qstream.checkpoint.safetensors_io import (
    DTYPE_NAMES,
    PlannedTensor,
    ShardReader,
    ShardWriter,
    TensorInfo,
    planned_file_size,
)
from qstream.errors import QStreamError
from qstream.formats import Energy, Format, snr_db
from qstream.formats.nvfp4 import tensor_amax
from qstream.progress import Progress
from qstream.publish import QUANTIZE_RECORD, publishing, write_json_atomic
from qstream.quant.schemes import Serving
from qstream.quant.select import Selection, share_group_amax
from qstream.vllm.profiles import head_targets, profile_for


@dataclass(frozen=True)
class Plan:
    checkpoint: Checkpoint
    selection: Selection
    format: Format
    ignore: list[str]  # the config's ignore entries, as written
    # output tensors per shard: the input's, in order, each quantized weight replaced in place
    # by what its format stores
    shards: dict[str, list[PlannedTensor]]
    # the config group's targets: "Linear", and any quantized ParallelLMHead by name
    targets: tuple[str, ...]
    serving: Serving

    @property
    def size_bytes(self) -> int:
        meta = {s: h.metadata for s, h in self.checkpoint.shards.items()}
        return sum(planned_file_size(t, meta[s]) for s, t in self.shards.items())


def make_plan(
    checkpoint: Checkpoint,
    selection: Selection,
    spec: Format,
    ignore: list[str],
    serving: Serving,
) -> Plan:
    quantized = set(selection.quantized)
    shards = {}
    for shard, header in checkpoint.shards.items():
        planned = []
        for name, info in header.tensors.items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module in quantized:
                planned += stored_tensors(spec, module, info)
            else:
                planned.append(PlannedTensor(name, info.dtype, info.shape))
            planned += [
                PlannedTensor(n, DTYPE_NAMES[t.dtype], tuple(t.shape))
                for n, t in serving.scales.get(name, {}).items()
            ]
        shards[shard] = planned
    profile = profile_for(checkpoint.config)
    targets = ("Linear", *head_targets(profile, selection.quantized))
    return Plan(checkpoint, selection, spec, ignore, shards, targets, serving)


@dataclass(frozen=True)
class Streaming:
    device: torch.device
    workers: int
    snr: bool = True
    progress: Progress | None = None


# Largest piece of a quantized weight (8 MiB of bf16): most weights stay whole, so NVFP4 needs
# no amax pre-pass for them.
PIECE_ELEMENTS = 1 << 22
COPY_BYTES = 8 << 20  # pieces of the byte copies of untouched tensors

R = TypeVar("R")  # what a piece's work returns


@dataclass(frozen=True)
class Piece:
    shard: str
    name: str
    rows: slice | None  # None: a whole 0-d / empty tensor
    module: str | None  # set when the tensor is a weight being quantized
    nbytes: int


def row_pieces(shard: str, info: TensorInfo, module: str | None) -> Iterator[Piece]:
    if not info.shape or info.numel == 0:
        yield Piece(shard, info.name, None, module, info.nbytes)
        return
    row_elements = max(1, info.numel // info.shape[0])
    limit = (
        COPY_BYTES // max(1, info.row_bytes) if module is None else PIECE_ELEMENTS // row_elements
    )
    step = max(1, limit)
    for start in range(0, info.shape[0], step):
        rows = slice(start, min(start + step, info.shape[0]))
        yield Piece(shard, info.name, rows, module, (rows.stop - rows.start) * info.row_bytes)


def pieces(plan: Plan, modules: set[str] | None = None) -> Iterator[Piece]:
    """Every tensor's pieces in file order, or only those of the quantized ``modules``."""
    quantized = set(plan.selection.quantized)
    for shard, header in plan.checkpoint.shards.items():
        for name, info in header.tensors.items():
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            module = module if module in quantized else None
            if modules is None or module in modules:
                yield from row_pieces(shard, info, module)


def run_bounded(
    work_items: Iterator[Piece],
    work: Callable[[Piece], R],
    workers: int,
    done: Callable[[Piece, R], None],
    prepare: Callable[[Piece], None] | None = None,
) -> None:
    """``work`` on every piece in a thread pool, at most ``2 * workers`` in flight; ``prepare``
    and ``done`` (in piece order) run on this thread, so that their I/O overlaps the workers."""
    in_flight: deque[tuple[Piece, Future]] = deque()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="qstream") as pool:
        try:
            for piece in work_items:
                if prepare is not None:
                    prepare(piece)
                in_flight.append((piece, pool.submit(work, piece)))
                if len(in_flight) >= 2 * workers:
                    p, fut = in_flight.popleft()
                    done(p, fut.result())
            while in_flight:
                p, fut = in_flight.popleft()
                done(p, fut.result())
        except BaseException:
            for _, fut in in_flight:
                fut.cancel()
            raise


def global_amaxes(
    plan: Plan, readers: dict[str, ShardReader], workers: int
) -> dict[str, torch.Tensor]:
    """The pre-pass of a format with a global scale: the amax of each weight whose global scale
    cannot come from the piece being quantized (a fused group's member, docs/quantize.md; a
    weight cut into several pieces), then each group's max."""
    if plan.format.global_scale is None:
        return {}
    amax: dict[str, torch.Tensor] = {}

    def work(piece: Piece) -> torch.Tensor:
        reader = readers[piece.shard]
        value = tensor_amax(reader.tensor(piece.name, piece.rows))
        reader.release(piece.name, piece.rows)
        return value

    def done(piece: Piece, value: torch.Tensor) -> None:
        if not torch.isfinite(value):
            raise QStreamError(f"{piece.name}: weight contains NaN or Inf")
        assert piece.module is not None  # the pre-pass reads quantized weights only
        previous = amax.get(piece.module)
        amax[piece.module] = value if previous is None else torch.maximum(previous, value)

    grouped = {m for group in plan.selection.fused_groups for m in group.members}
    split = {
        m
        for m in plan.selection.quantized
        if len(list(row_pieces("", plan.checkpoint.info(f"{m}.weight"), m))) > 1
    }
    if grouped | split:
        run_bounded(pieces(plan, grouped | split), work, workers, done)
    return share_group_amax(amax, plan.selection.fused_groups)


def write_tensors(
    plan: Plan,
    readers: dict[str, ShardReader],
    writers: dict[str, ShardWriter],
    amaxes: dict[str, torch.Tensor],
    run: Streaming,
) -> dict[str, float]:
    """Every piece read, quantized or copied, and written; each quantized module's SNR in dB."""
    checkpoint, quantized = plan.checkpoint, plan.selection.quantized
    sums = {m: [0.0, 0.0] for m in quantized}
    tensors_total, tensors_done = len(checkpoint.tensor_shard), 0
    if run.progress is not None:
        run.progress.start(sum(h.file_size - h.data_offset for h in checkpoint.shards.values()))

    def prepare(piece: Piece) -> None:
        if piece.module is not None:
            readers[piece.shard].prefetch(piece.name, piece.rows)

    def work(piece: Piece):
        if piece.module is None:
            return None
        energy = Energy(run.device) if run.snr else None
        reader = readers[piece.shard]
        w = reader.tensor(piece.name, piece.rows).to(run.device)
        stored = plan.format.quantize(w, piece.name, amaxes.get(piece.module), energy)
        reader.release(piece.name, piece.rows)
        return stored, None if energy is None else energy.sums()

    def done(piece: Piece, result) -> None:
        nonlocal tensors_done
        writer, rows = writers[piece.shard], piece.rows
        if result is None:
            _copy_piece(readers[piece.shard], writer, piece)
        else:
            stored, energy = result
            _write_stored(writer, piece, stored, plan.format.global_scale)
            if energy is not None and piece.module is not None:
                sums[piece.module] = [a + b for a, b in zip(sums[piece.module], energy)]
        _write_scales(writer, piece, plan.serving.scales.get(piece.name, {}))
        if rows is None or rows.stop == checkpoint.info(piece.name).shape[0]:
            tensors_done += 1
        if run.progress is not None:
            run.progress.advance(f"tensors {tensors_done}/{tensors_total}", piece.nbytes)

    run_bounded(pieces(plan), work, run.workers, done, prepare)
    return {m: snr_db(*sums[m]) for m in quantized} if run.snr else {}


def _write_scales(writer: ShardWriter, piece: Piece, scales: dict[str, torch.Tensor]) -> None:
    if piece.rows is None or piece.rows.start == 0:
        for name, tensor in scales.items():
            writer.write(name, tensor)


def _copy_piece(reader: ShardReader, writer: ShardWriter, piece: Piece) -> None:
    info = reader.header.tensors[piece.name]
    rows = piece.rows or slice(0, 1)  # a whole 0-d / empty tensor: its bytes from 0
    begin = rows.start * info.row_bytes
    end = info.nbytes if piece.rows is None else rows.stop * info.row_bytes
    writer.write(piece.name, reader.raw(piece.name, begin, end), rows.start)
    reader.release(piece.name, piece.rows)


def _write_stored(
    writer: ShardWriter, piece: Piece, stored: dict[str, torch.Tensor], once: str | None
) -> None:
    """One quantized piece's stored rows; the per-tensor scale ``once`` with the first rows."""
    assert piece.rows is not None  # quantized weights are 2-D, cut into row ranges
    for suffix, tensor in stored.items():
        if suffix != once:
            writer.write(f"{piece.module}.{suffix}", tensor, piece.rows.start)
        elif piece.rows.start == 0:
            writer.write(f"{piece.module}.{suffix}", tensor)


def write_checkpoint(
    plan: Plan,
    output_path: Path,
    *,
    overwrite: bool,
    run: Streaming,
    record: Callable[[dict[str, float]], dict],
) -> dict[str, float]:
    """The global-amax pre-pass, then every file of the output; returns the weight SNR per
    quantized module.  ``record(snr_db)``: the head of QUANTIZE_RECORD (the files' sha256 added)."""
    checkpoint = plan.checkpoint
    readers = {name: ShardReader(h) for name, h in checkpoint.shards.items()}
    amaxes = global_amaxes(plan, readers, run.workers)
    with publishing(output_path, overwrite) as tmp:
        _copy_other_files(checkpoint, tmp)
        config = dict(checkpoint.config)
        config["quantization_config"] = quantization_config(
            plan.format,
            list(plan.ignore),
            list(plan.targets),
            plan.serving.activations,
            plan.serving.kv_cache is not None,
        )
        write_json_atomic(tmp / CONFIG_NAME, config)
        writers = {
            s: ShardWriter(tmp / s, tensors, checkpoint.shards[s].metadata, digest=True)
            for s, tensors in plan.shards.items()
        }
        try:
            snr_db = write_tensors(plan, readers, writers, amaxes, run)
        except BaseException:
            for writer in writers.values():
                writer.abort()
            raise
        digests = {}
        for shard, writer in writers.items():
            digest = writer.close()
            assert digest is not None  # made with digest=True
            digests[shard] = digest
        if checkpoint.has_index or len(writers) != 1:
            weight_map = {name: shard for shard, w in writers.items() for name in w.infos}
            total = sum(i.nbytes for w in writers.values() for i in w.infos.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            write_json_atomic(tmp / INDEX_NAME, index)
        files = file_digests(tmp, known=digests)
        write_json_atomic(tmp / QUANTIZE_RECORD, {**record(snr_db), "files": files})
    return snr_db


def _copy_other_files(checkpoint: Checkpoint, tmp: Path) -> None:
    """Everything but the weights, the index, config.json and hidden entries (.git, .cache)."""
    skip = checkpoint.weight_files | {CONFIG_NAME}
    for entry in sorted(checkpoint.directory.iterdir()):
        if entry.name in skip or entry.name.startswith("."):
            continue
        try:
            if entry.is_dir():
                shutil.copytree(entry, tmp / entry.name)
            else:
                shutil.copy2(entry, tmp / entry.name)
        except OSError as exc:
            raise QStreamError(f"cannot copy {entry}: {exc}") from exc
