"""``quantize_checkpoint``: a safetensors checkpoint in, an FP8 / MXFP4 / NVFP4 checkpoint in
the compressed-tensors layout out (docs/quantize.md), planned whole before a byte is written.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

import qstream
from qstream.checkpoint.files import CONFIG_NAME, Checkpoint, open_checkpoint
from qstream.errors import QStreamError
from qstream.formats import QUANTIZED_SUFFIXES, get_format
from qstream.progress import Progress
from qstream.publish import check_outside, check_target
from qstream.quant.schemes import serving_record, serving_schemes
from qstream.quant.select import Selection, select_modules, weight_modules
from qstream.quant.write import Plan, Streaming, make_plan, write_checkpoint
from qstream.vllm.profiles import (
    head_problem,
    ignore_entries,
    layer_specific_warning,
    profile_for,
    target_layers_of,
    tp_build_problem,
)
from qstream.vllm.shapes import d2t_problems, shape_problems


@dataclass(frozen=True)
class QuantizeSummary:
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
    workers: int = 1  # threads that quantized in parallel
    serving_profile: str = "generic"  # whose loading rules the selection follows (docs/vllm.md)
    tensor_parallel_size: int = 1  # the TP size the selection was checked for
    ignore: list[str] = field(default_factory=list)  # the config's ignore entries, as written
    warnings: list[str] = field(default_factory=list)  # e.g. ignore entries that depend on L
    # beyond the weights: {"activations", "kv_cache_scheme", "calibration": its source record}
    # for the schemes written (docs/quantize.md); empty, and left out of the JSON, if weight-only
    serving: dict = field(default_factory=dict)

    @property
    def mean_snr_db(self) -> float | None:
        values = list(self.weight_snr_db.values())
        return sum(values) / len(values) if values else None

    @property
    def worst_snr(self) -> tuple[str, float] | None:
        return min(self.weight_snr_db.items(), key=lambda kv: kv[1]) if self.weight_snr_db else None

    def to_json(self) -> dict:
        data = asdict(self)
        if not self.serving:
            del data["serving"]
        worst = self.worst_snr
        data.update(
            params_quantized_pct=100.0 * self.params_quantized / max(1, self.params_total),
            size_ratio_pct=100.0 * self.bytes_after / max(1, self.bytes_before),
            mean_snr_db=self.mean_snr_db,
            worst_snr_db=None if worst is None else {"module": worst[0], "db": worst[1]},
        )
        return data


def quantize_checkpoint(
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    fmt: str,
    include: list[str] | None = None,
    ignore: list[str] | None = None,
    device: str = "cpu",
    workers: int | None = None,
    dry_run: bool = False,
    overwrite: bool = False,
    skip_incompatible: bool = False,
    progress: Progress | None = None,
    snr: bool = True,
    tensor_parallel_size: int = 1,
    activations: str = "none",
    kv_cache_scheme: str | None = None,
    calibration: Any = None,
) -> QuantizeSummary:
    """``model_dir`` with the selected Linear weights quantized to ``fmt`` (docs/quantize.md;
    the selection: docs/vllm.md), published atomically (docs/guarantees.md).  ``calibration``: a
    Calibration, or a callable run once the options are checked."""
    started = time.perf_counter()
    spec = get_format(fmt)
    workers = default_workers() if workers is None else workers
    model_path, output_path = _check_paths(model_dir, output_dir, overwrite)
    run = Streaming(_check_device(device, workers), workers, snr, progress)
    checkpoint = _check_against_config(_refuse_quantized(open_checkpoint(model_path)))
    selection, entries, warnings = _select(
        checkpoint, fmt, include, ignore, skip_incompatible, tensor_parallel_size
    )
    serving = serving_schemes(checkpoint, fmt, selection, activations, kv_cache_scheme, calibration)
    plan = make_plan(checkpoint, selection, spec, entries, serving)
    summary = _plan_summary(
        plan, warnings, dry_run=dry_run, quant_format=fmt, model_dir=str(model_path),
        output_dir=str(output_path), workers=workers, tensor_parallel_size=tensor_parallel_size,
        serving=serving_record(serving),
    )  # fmt: skip
    if dry_run:
        return summary
    options = serving_record(serving, command=True)
    command = _equivalent_command(model_dir, output_dir, fmt, include, ignore, skip_incompatible,
                                  snr, tensor_parallel_size, options)  # fmt: skip
    record = partial(_record, summary, command)
    with _one_intra_op_thread():
        snr_db = write_checkpoint(plan, output_path, overwrite=overwrite, run=run, record=record)
    return replace(summary, weight_snr_db=snr_db, seconds=time.perf_counter() - started)


def _record(summary: QuantizeSummary, command: str, snr_db: dict[str, float]) -> dict:
    """The head of the run's record, without the run-dependent time and workers."""
    recorded = replace(summary, weight_snr_db=snr_db).to_json()
    return {
        "qstream_version": qstream.__version__,
        "command": command,
        "summary": {k: v for k, v in recorded.items() if k not in ("seconds", "workers")},
    }


@contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """One torch intra-op thread per worker: intra-op barriers cost more than they gain."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _plan_summary(plan: Plan, warnings: list[str], **settings: Any) -> QuantizeSummary:
    checkpoint, selection = plan.checkpoint, plan.selection
    return QuantizeSummary(
        params_total=sum(i.numel for i in checkpoint.tensors.values()),
        params_quantized=sum(checkpoint.info(f"{m}.weight").numel for m in selection.quantized),
        modules_quantized=list(selection.quantized),
        modules_ignored=list(selection.ignored),
        modules_skipped=dict(selection.skipped),
        bytes_before=checkpoint.size_bytes,
        bytes_after=plan.size_bytes,
        serving_profile=selection.profile.name,
        ignore=plan.ignore,
        warnings=warnings,
        **settings,
    )


def default_workers() -> int:
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _select(
    checkpoint: Checkpoint, fmt: str, include, ignore, skip_incompatible: bool, tp_size: int
) -> tuple[Selection, list[str], list[str]]:
    """The selection, the ``ignore`` entries vLLM's matcher resolves it with, and warnings
    (docs/vllm.md)."""
    if tp_size < 1:
        raise QStreamError(f"--tensor-parallel-size {tp_size}: must be at least 1")
    profile = profile_for(checkpoint.config)
    modules = weight_modules(checkpoint.tensors)
    shapes = {m: tuple(info.shape) for m, info in modules.items()}
    cannot = tp_build_problem(profile, checkpoint.config, shapes, tp_size)
    if cannot:
        raise QStreamError(
            f"--tensor-parallel-size {tp_size}: vLLM 0.32.0 cannot build this "
            f"draft at it: {cannot} (docs/vllm.md)"
        )
    include = include or list(profile.default_include)
    selection = select_modules(
        checkpoint.tensors, fmt, include, ignore, skip_incompatible, profile, tp_size
    )
    for module in selection.quantized:
        why = head_problem(profile, module, fmt, checkpoint.config)
        if why:
            raise QStreamError(f"{module}: vLLM cannot serve it quantized: {why} (docs/vllm.md)")
    target_layers = target_layers_of(checkpoint.config)
    entries = ignore_entries(profile, selection.ignored, modules, target_layers)
    warnings = [w for w in [layer_specific_warning(profile, entries, target_layers)] if w]
    return selection, entries, warnings


def _equivalent_command(
    model_dir, output_dir, fmt: str, include, ignore, skip_incompatible: bool, snr: bool,
    tensor_parallel_size: int, serving: dict[str, str],
) -> str:  # fmt: skip
    args = ["qstream-quantize", "--model_dir", str(model_dir), "--output_dir", str(output_dir)]
    args += ["--quant_format", fmt]
    if include:
        args += ["--include_layers", *include]
    if ignore:
        args += ["--ignore_layers", *ignore]
    if skip_incompatible:
        args.append("--skip-incompatible")
    if not snr:
        args.append("--no-snr")
    if tensor_parallel_size != 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    for option, value in serving.items():
        args += [f"--{option.replace('_', '-')}", value]
    return shlex.join(args)


def _check_paths(model_dir, output_dir, overwrite: bool) -> tuple[Path, Path]:
    model_path, output_path = Path(model_dir).resolve(), Path(output_dir).resolve()
    if not model_path.is_dir():
        raise QStreamError(f"--model_dir {model_dir}: not a directory")
    check_outside(output_dir, "--output_dir", {"--model_dir": model_dir})
    check_target(output_path, overwrite, "--output_dir")
    return model_path, output_path


def _check_device(device: str, workers: int) -> torch.device:
    if workers < 1:
        raise QStreamError(f"--workers {workers}: must be at least 1")
    if device not in ("cpu", "cuda"):
        raise QStreamError(f"--device {device!r}: choose cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise QStreamError("--device cuda: no CUDA device is available")
    return torch.device(device)


def _check_against_config(checkpoint: Checkpoint) -> Checkpoint:
    """``checkpoint``, unless its tensors differ from what config.json implies (docs/quantize.md,
    "Tensors checked against the config")."""
    stored = {name: tuple(info.shape) for name, info in checkpoint.tensors.items()}
    problems = shape_problems(profile_for(checkpoint.config), checkpoint.config, stored)
    problems = problems or d2t_problems(checkpoint)
    if not problems:
        return checkpoint
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    where, first = checkpoint.directory, problems[0]
    if first.startswith(f"{CONFIG_NAME}: "):  # name the file itself
        where, first = where / CONFIG_NAME, first.removeprefix(f"{CONFIG_NAME}: ")
    raise QStreamError(f"{where}: {first}{more}")


def _refuse_quantized(checkpoint: Checkpoint) -> Checkpoint:
    if "quantization_config" in checkpoint.config:
        method = checkpoint.config["quantization_config"]
        method = method.get("quant_method", "?") if isinstance(method, dict) else "?"
        raise QStreamError(
            f"{checkpoint.directory / CONFIG_NAME}: the checkpoint is already "
            f"quantized (quantization_config, quant_method {method!r})"
        )
    for name in checkpoint.tensor_shard:
        if name.endswith(tuple(f".{s}" for s in QUANTIZED_SUFFIXES)):
            raise QStreamError(
                f"tensor {name!r} in {checkpoint.tensor_shard[name]}: the "
                "checkpoint is already quantized"
            )
    return checkpoint
