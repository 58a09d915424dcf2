"""``quantize_checkpoint``: a safetensors checkpoint in, a weight-only FP8 / MXFP4 / NVFP4
checkpoint in the compressed-tensors layout out (DESIGN.md sections 2 and 4), with no model class.

The run is planned whole before anything is written: the checkpoint's headers and index are
validated, the selection is resolved, every output shard's header is laid out, and (NVFP4) the
amax pre-pass gives each tensor or fused group its global scale.  Then work proceeds in pieces
of at most ``PIECE_ELEMENTS`` elements (a row range of one tensor), so that memory is bounded
by ``workers`` pieces, never by a tensor, a shard or the model: each piece is read from a
memory map, quantized, and written at its offset in a temporary directory that is renamed into
place at the end.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import qstream
from qstream.checkpoint.files import CONFIG_NAME, INDEX_NAME, Checkpoint, open_checkpoint
from qstream.checkpoint.layout import quantization_config, stored_tensors
from qstream.checkpoint.safetensors_io import (
    PlannedTensor,
    ShardReader,
    ShardWriter,
    TensorInfo,
    planned_file_size,
)
from qstream.checkpoint.selection import (
    Selection,
    select_modules,
    share_group_amax,
    weight_modules,
)
from qstream.checkpoint.serving import (
    ignore_entries,
    layer_specific_warning,
    profile_for,
    target_layers_of,
)
from qstream.errors import QStreamError
from qstream.formats import dequantize, get_format, quantize, snr_db, snr_sums
from qstream.formats.nvfp4 import tensor_amax

# Written beside config.json: the command and summary that produced the checkpoint, which
# `qstream card` quotes (the card never has to reconstruct the command).
PROVENANCE_NAME = "qstream_quantize.json"
# Largest piece of work: 512K elements is 1 MiB of bf16 input; with the float32 temporaries
# a piece costs ~15 MB, so memory stays near workers x 15 MB whatever the tensor sizes.
PIECE_ELEMENTS = 1 << 19
# Byte copies of untouched tensors go in pieces of this size (mapped pages count as resident
# until released).
COPY_BYTES = 8 << 20

Progress = Callable[[int, int, int, int], None]  # bytes done, bytes total, tensors done, total


@dataclass(frozen=True)
class QuantizeSummary:
    """What a run did (or, with ``dry_run``, would do)."""

    model_dir: str
    output_dir: str
    quant_format: str
    dry_run: bool
    params_total: int  # elements of every tensor in the input
    params_quantized: int  # elements of the quantized weights
    modules_quantized: list[str]
    modules_ignored: list[str]  # the config's ignore list (skipped modules included)
    modules_skipped: dict[str, str]  # selected but left unquantized (--skip-incompatible)
    bytes_before: int  # safetensors files of the input
    bytes_after: int  # safetensors files of the output (exact, also on a dry run)
    weight_snr_db: dict[str, float] = field(default_factory=dict)  # per quantized module
    seconds: float = 0.0
    serving_profile: str = "generic"  # whose loading rules the selection follows (docs/vllm.md)
    tensor_parallel_size: int = 1  # the TP size the selection was checked for
    ignore: list[str] = field(default_factory=list)  # the config's ignore entries, as written
    warnings: list[str] = field(default_factory=list)  # what vLLM may refuse (Marlin shapes)

    @property
    def mean_snr_db(self) -> float | None:
        values = list(self.weight_snr_db.values())
        return sum(values) / len(values) if values else None

    @property
    def worst_snr(self) -> tuple[str, float] | None:
        return min(self.weight_snr_db.items(), key=lambda kv: kv[1]) if self.weight_snr_db \
            else None

    def to_json(self) -> dict:
        data = asdict(self)
        worst = self.worst_snr
        data.update(
            params_quantized_pct=100.0 * self.params_quantized / max(1, self.params_total),
            size_ratio_pct=100.0 * self.bytes_after / max(1, self.bytes_before),
            mean_snr_db=self.mean_snr_db,
            worst_snr_db=None if worst is None else {"module": worst[0], "db": worst[1]},
        )
        return data


@dataclass(frozen=True)
class _Piece:
    """One unit of work: rows ``rows`` of tensor ``name`` of input shard ``shard``."""

    shard: str
    name: str
    rows: slice | None  # None: a whole 0-d / empty tensor
    module: str | None  # set when the tensor is a weight being quantized
    nbytes: int


def quantize_checkpoint(
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    fmt: str,
    include: list[str] | None = None,
    ignore: list[str] | None = None,
    device: str = "cpu",
    workers: int = 1,
    dry_run: bool = False,
    overwrite: bool = False,
    skip_incompatible: bool = False,
    progress: Progress | None = None,
    tensor_parallel_size: int = 1,
) -> QuantizeSummary:
    """Write ``output_dir``: ``model_dir`` with the selected Linear weights quantized to ``fmt``
    ("fp8", "mxfp4" or "nvfp4") in the compressed-tensors layout.

    ``include`` / ``ignore`` are DESIGN.md section 2 patterns (``ignore`` wins; default: every
    2-D Linear weight except embeddings, lm_head and MoE routers).  ``skip_incompatible`` leaves
    weights whose K is not a multiple of the block size unquantized instead of failing.
    The serving profile of config.json's architecture (docs/vllm.md) adds vLLM's rules: fused
    groups, modules vLLM never quantizes, and what it keeps in BF16 at
    ``tensor_parallel_size``; the ``ignore`` list is written so that vLLM's matcher resolves
    it under its runtime module names.
    ``device`` "cuda" quantizes on the GPU (same bytes).  Parallelism comes from ``workers``
    threads with one torch intra-op thread each (torch's setting is restored on return): on a
    busy machine, intra-op thread barriers cost far more than they gain on small pieces.
    Raises QStreamError, having written nothing, for any problem with the input or options.
    """
    started = time.perf_counter()
    get_format(fmt)
    model_path, output_path = _check_paths(model_dir, output_dir, overwrite)
    torch_device = _check_device(device, workers)
    checkpoint = open_checkpoint(model_path)
    _refuse_quantized(checkpoint)
    if tensor_parallel_size < 1:
        raise QStreamError(f"--tensor-parallel-size {tensor_parallel_size}: must be at least 1")
    profile = profile_for(checkpoint.config)
    hidden = checkpoint.config.get("hidden_size")
    selection = select_modules(checkpoint.tensors, fmt, include, ignore, skip_incompatible,
                               profile=profile, hidden_size=hidden if isinstance(hidden, int)
                               else None, tensor_parallel_size=tensor_parallel_size)
    target_layers = target_layers_of(checkpoint.config)
    entries = ignore_entries(profile, selection.ignored, weight_modules(checkpoint.tensors),
                             target_layers)
    warnings = list(selection.warnings)
    warnings += filter(None, [layer_specific_warning(entries, target_layers)])
    plans = _plan_shards(checkpoint, selection, fmt)
    summary = QuantizeSummary(
        model_dir=str(model_path), output_dir=str(output_path), quant_format=fmt,
        dry_run=dry_run,
        params_total=sum(i.numel for i in checkpoint.tensors.values()),
        params_quantized=sum(checkpoint.info(f"{m}.weight").numel for m in selection.quantized),
        modules_quantized=list(selection.quantized), modules_ignored=list(selection.ignored),
        modules_skipped=dict(selection.skipped), bytes_before=checkpoint.size_bytes,
        bytes_after=sum(planned_file_size(t, checkpoint.shards[s].metadata)
                        for s, t in plans.items()),
        serving_profile=profile.name, tensor_parallel_size=tensor_parallel_size,
        ignore=entries, warnings=warnings,
    )
    if dry_run:
        return summary
    readers = {name: ShardReader(h) for name, h in checkpoint.shards.items()}
    tmp = output_path.parent / f".{output_path.name}.qstream-partial-{os.getpid()}"
    intra_op_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        amaxes = _global_amaxes(checkpoint, readers, selection, workers) if fmt == "nvfp4" \
            else {}
        tmp.mkdir()
        snr = _write_checkpoint(checkpoint, readers, selection, plans, fmt, amaxes, entries,
                                tmp, torch_device, workers, progress)
        command = _equivalent_command(model_dir, output_dir, fmt, include, ignore,
                                      skip_incompatible, tensor_parallel_size)
        _write_text(tmp / PROVENANCE_NAME, _json({
            "qstream_version": qstream.__version__, "command": command,
            "summary": {k: v for k, v in QuantizeSummary(**{**asdict(summary),
                                                             "weight_snr_db": snr}).to_json().items()
                        if k != "seconds"}}))
        _move_into_place(tmp, output_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(intra_op_threads)
    return QuantizeSummary(**{**asdict(summary), "weight_snr_db": snr,
                              "seconds": time.perf_counter() - started})


def _equivalent_command(model_dir, output_dir, fmt: str, include, ignore,
                        skip_incompatible: bool, tensor_parallel_size: int) -> str:
    """The qstream-quantize command line that makes this output (recorded for model cards)."""
    args = ["qstream-quantize", "--model_dir", str(model_dir), "--output_dir", str(output_dir),
            "--quant_format", fmt]
    if include:
        args += ["--include_layers", *include]
    if ignore:
        args += ["--ignore_layers", *ignore]
    if skip_incompatible:
        args.append("--skip-incompatible")
    if tensor_parallel_size != 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    return shlex.join(args)


def _check_paths(model_dir, output_dir, overwrite: bool) -> tuple[Path, Path]:
    model_path, output_path = Path(model_dir).resolve(), Path(output_dir).resolve()
    if not model_path.is_dir():
        raise QStreamError(f"--model_dir {model_dir}: not a directory")
    if output_path == model_path or model_path in output_path.parents:
        raise QStreamError(f"--output_dir {output_dir} is inside --model_dir {model_dir}; the "
                           "input is never modified")
    if output_path in model_path.parents:
        raise QStreamError(f"--output_dir {output_dir} contains --model_dir {model_dir}")
    if output_path.exists() and not overwrite:
        raise QStreamError(f"--output_dir {output_dir} already exists (use --overwrite)")
    if output_path.exists() and not output_path.is_dir():
        raise QStreamError(f"--output_dir {output_dir} exists and is not a directory")
    if not output_path.parent.is_dir():
        raise QStreamError(f"--output_dir {output_dir}: parent directory does not exist")
    return model_path, output_path


def _check_device(device: str, workers: int) -> torch.device:
    if workers < 1:
        raise QStreamError(f"--workers {workers}: must be at least 1")
    if device not in ("cpu", "cuda"):
        raise QStreamError(f"--device {device!r}: choose cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise QStreamError("--device cuda: no CUDA device is available")
    return torch.device(device)


def _refuse_quantized(checkpoint: Checkpoint) -> None:
    if "quantization_config" in checkpoint.config:
        method = checkpoint.config["quantization_config"]
        method = method.get("quant_method", "?") if isinstance(method, dict) else "?"
        raise QStreamError(f"{checkpoint.directory / CONFIG_NAME}: the checkpoint is already "
                           f"quantized (quantization_config, quant_method {method!r})")
    for name in checkpoint.tensor_shard:
        if name.endswith((".weight_packed", ".weight_scale", ".weight_global_scale")):
            raise QStreamError(f"tensor {name!r} in {checkpoint.tensor_shard[name]}: the "
                               "checkpoint is already quantized")


def _plan_shards(checkpoint: Checkpoint, selection: Selection, fmt: str
                 ) -> dict[str, list[PlannedTensor]]:
    """Output tensors per shard: the input's, in order, each quantized weight replaced in place
    by what its format stores."""
    quantized = set(selection.quantized)
    plans = {}
    for shard, header in checkpoint.shards.items():
        planned = []
        for name, info in header.tensors.items():
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            if module in quantized:
                planned += stored_tensors(fmt, module, info)
            else:
                planned.append(PlannedTensor(name, info.dtype, info.shape))
        plans[shard] = planned
    return plans


def _row_pieces(shard: str, info: TensorInfo, module: str | None) -> Iterator[_Piece]:
    if not info.shape or info.numel == 0:
        yield _Piece(shard, info.name, None, module, info.nbytes)
        return
    row_elements = max(1, info.numel // info.shape[0])
    limit = COPY_BYTES // max(1, info.row_bytes) if module is None \
        else PIECE_ELEMENTS // row_elements
    step = max(1, limit)
    for start in range(0, info.shape[0], step):
        rows = slice(start, min(start + step, info.shape[0]))
        yield _Piece(shard, info.name, rows, module, (rows.stop - rows.start) * info.row_bytes)


def _pieces(checkpoint: Checkpoint, selection: Selection,
            modules: set[str] | None = None) -> Iterator[_Piece]:
    quantized = set(selection.quantized)
    for shard, header in checkpoint.shards.items():
        for name, info in header.tensors.items():
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            module = module if module in quantized else None
            if modules is None or module in modules:
                yield from _row_pieces(shard, info, module)


def _run_bounded(pieces: Iterator[_Piece], work: Callable[[_Piece], object], workers: int,
                 done: Callable[[_Piece, object], None]) -> None:
    """``work`` on every piece in a thread pool (torch releases the GIL), with at most
    ``2 * workers`` pieces in flight so that memory stays bounded."""
    in_flight: deque[tuple[_Piece, Future]] = deque()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="qstream") as pool:
        try:
            for piece in pieces:
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


def _global_amaxes(checkpoint: Checkpoint, readers: dict[str, ShardReader],
                   selection: Selection, workers: int) -> dict[str, torch.Tensor]:
    """NVFP4's pre-pass: each quantized weight's amax, then the max over each fused group, so
    that a group shares one global scale even across shards (DESIGN.md section 4).  A NaN or
    Inf weight is refused here, before anything is written."""
    amax: dict[str, torch.Tensor] = {}

    def work(piece: _Piece) -> torch.Tensor:
        reader = readers[piece.shard]
        value = tensor_amax(reader.tensor(piece.name, piece.rows))
        reader.release(piece.name, piece.rows)
        return value

    def done(piece: _Piece, value: torch.Tensor) -> None:
        if not torch.isfinite(value):
            raise QStreamError(f"{piece.name}: weight contains NaN or Inf")
        previous = amax.get(piece.module)
        amax[piece.module] = value if previous is None else torch.maximum(previous, value)

    _run_bounded(_pieces(checkpoint, selection, set(selection.quantized)), work, workers, done)
    return share_group_amax(amax, selection.fused_groups)


def _write_checkpoint(checkpoint, readers, selection, plans, fmt, amaxes, ignore, tmp: Path,
                      device: torch.device, workers: int, progress: Progress | None
                      ) -> dict[str, float]:
    _copy_other_files(checkpoint, tmp)
    config = dict(checkpoint.config)
    config["quantization_config"] = quantization_config(fmt, list(ignore))
    _write_text(tmp / CONFIG_NAME, _json(config))
    writers = {s: ShardWriter(tmp / s, plans[s], checkpoint.shards[s].metadata) for s in plans}
    sums: dict[str, list[float]] = {m: [0.0, 0.0] for m in selection.quantized}
    totals = {"bytes": sum(h.file_size - h.data_offset for h in checkpoint.shards.values()),
              "tensors": len(checkpoint.tensor_shard)}
    state = {"bytes": 0, "tensors": 0}

    def work(piece: _Piece):
        reader, writer = readers[piece.shard], writers[piece.shard]
        if piece.module is None:
            _copy_piece(reader, writer, piece)
            return None
        result = _quantize_piece(reader, writer, piece, fmt, amaxes.get(piece.module), device)
        reader.release(piece.name, piece.rows)
        return result

    def done(piece: _Piece, result) -> None:
        if result is not None:
            sums[piece.module][0] += result[0]
            sums[piece.module][1] += result[1]
        state["bytes"] += piece.nbytes
        info = checkpoint.info(piece.name)
        if piece.rows is None or piece.rows.stop == info.shape[0]:
            state["tensors"] += 1
        if progress is not None:
            progress(state["bytes"], totals["bytes"], state["tensors"], totals["tensors"])

    try:
        _run_bounded(_pieces(checkpoint, selection), work, workers, done)
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    for writer in writers.values():
        writer.close()
    _write_index(checkpoint, writers, tmp)
    return {m: snr_db(*sums[m]) for m in selection.quantized}


def _copy_piece(reader: ShardReader, writer: ShardWriter, piece: _Piece) -> None:
    info = reader.header.tensors[piece.name]
    if piece.rows is None:
        begin, end, row = 0, info.nbytes, 0
    else:
        begin, end, row = (piece.rows.start * info.row_bytes, piece.rows.stop * info.row_bytes,
                           piece.rows.start)
    writer.write(piece.name, reader.raw(piece.name, begin, end), row)
    reader.release(piece.name, piece.rows)


def _quantize_piece(reader: ShardReader, writer: ShardWriter, piece: _Piece, fmt: str,
                    global_amax: torch.Tensor | None, device: torch.device
                    ) -> tuple[float, float]:
    """Quantize rows of one weight, write each stored tensor's rows, and return the piece's
    ``(sum w^2, sum (w - w_hat)^2)`` in float64 for the weight SNR."""
    w = reader.tensor(piece.name, piece.rows).to(device)
    stored = quantize(fmt, w, name=piece.name, global_amax=global_amax)
    module = piece.module
    for suffix, tensor in stored.items():
        if suffix == "weight_global_scale":
            if piece.rows.start == 0:
                writer.write(f"{module}.{suffix}", tensor)
        else:
            writer.write(f"{module}.{suffix}", tensor, piece.rows.start)
    return snr_sums(w, dequantize(fmt, stored, dtype=w.dtype))


def _copy_other_files(checkpoint: Checkpoint, tmp: Path) -> None:
    """Tokenizer, generation config, chat template, ...: everything but the weights, the index
    and config.json (rewritten); hidden top-level entries (.git, .cache) are not copied."""
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


def _write_index(checkpoint: Checkpoint, writers: dict[str, ShardWriter], tmp: Path) -> None:
    if not checkpoint.has_index and len(writers) == 1:
        return
    weight_map = {name: shard for shard, w in writers.items() for name in w.infos}
    total = sum(i.nbytes for w in writers.values() for i in w.infos.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_text(tmp / INDEX_NAME, _json(index))


def _json(data) -> str:
    return json.dumps(data, indent=2) + "\n"


def _write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def _move_into_place(tmp: Path, output: Path) -> None:
    """Rename the finished temporary directory to ``output``; an existing output (allowed by
    --overwrite) is moved aside first and removed only once the new one is in place."""
    old = None
    if output.exists():
        old = output.parent / f".{output.name}.qstream-old-{os.getpid()}"
        output.rename(old)
    tmp.rename(output)
    if old is not None:
        shutil.rmtree(old)
