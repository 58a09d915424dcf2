"""``verify_checkpoint``: the structural checks of a quantized checkpoint that vLLM would
otherwise discover at load time (DESIGN.md section 4), plus a dequantize round trip.

Malformed files (bad header, inconsistent index) raise QStreamError when the checkpoint is
opened; everything else is collected as a list of problems, empty for a good checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from qstream.checkpoint.files import Checkpoint, open_checkpoint
from qstream.checkpoint.layout import format_of_layout
from qstream.checkpoint.safetensors_io import ShardReader
from qstream.checkpoint.selection import fused_groups, matches
from qstream.errors import QStreamError
from qstream.formats import FORMATS, dequantize

ROWS_PER_CHECK = 1 << 21  # elements dequantized at a time


@dataclass
class VerifyReport:
    directory: str
    quant_format: str | None = None
    modules_quantized: list[str] = field(default_factory=list)
    modules_ignored: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(directory: str | Path) -> VerifyReport:
    checkpoint = open_checkpoint(directory)
    report = VerifyReport(str(checkpoint.directory))
    qconfig = checkpoint.config.get("quantization_config")
    if not isinstance(qconfig, dict):
        raise QStreamError(f"{checkpoint.directory}: config.json has no quantization_config; "
                           "not a quantized checkpoint")
    fmt = _check_config(qconfig, report)
    if fmt is None:
        return report
    report.quant_format = fmt
    quantized, holders = _modules(checkpoint, fmt)
    report.modules_quantized = [m for m in holders if m in quantized]
    ignore = qconfig.get("ignore") or []
    report.modules_ignored = [m for m in holders if any(matches_ignore(p, m) for p in ignore)]
    targets = next(iter(qconfig["config_groups"].values())).get("targets") or []
    _check_accounting(holders, quantized, targets, ignore, report)
    malformed = _check_stored(checkpoint, fmt, quantized, report)
    _check_fused(checkpoint, fmt, holders, quantized, report)
    _check_round_trip(checkpoint, fmt, quantized - malformed, report)
    return report


def matches_ignore(entry: str, module: str) -> bool:
    """compressed-tensors / vLLM semantics for ignore entries: equal, or ``re:`` regex."""
    return matches(entry, module) if entry.startswith("re:") else entry == module


def _check_config(qconfig: dict, report: VerifyReport) -> str | None:
    problems = report.problems
    if qconfig.get("quant_method") != "compressed-tensors":
        problems.append(f"quant_method is {qconfig.get('quant_method')!r}, not "
                        "'compressed-tensors'")
    if qconfig.get("quantization_status") != "compressed":
        problems.append(f"quantization_status is {qconfig.get('quantization_status')!r}, not "
                        "'compressed'")
    groups = qconfig.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        problems.append(f"expected exactly one config group, found "
                        f"{len(groups) if isinstance(groups, dict) else 'none'}")
        return None
    group = next(iter(groups.values()))
    fmt = format_of_layout(qconfig.get("format", ""))
    if fmt is None:
        problems.append(f"format {qconfig.get('format')!r} is not one qstream writes "
                        f"({', '.join(s.layout for s in FORMATS.values())})")
        return None
    if group.get("format", qconfig.get("format")) != qconfig.get("format"):
        problems.append(f"config group format {group.get('format')!r} differs from "
                        f"{qconfig.get('format')!r}")
    weights = group.get("weights") or {}
    for key, value in FORMATS[fmt].weights_args.items():
        if weights.get(key) != value:
            problems.append(f"config group weights.{key} is {weights.get(key)!r}, the "
                            f"{FORMATS[fmt].layout} format needs {value!r}")
    if group.get("input_activations") or group.get("output_activations"):
        problems.append("config group quantizes activations; qstream checkpoints are "
                        "weight-only")
    targets = group.get("targets") or []
    named = [t for t in targets if t != "Linear"]
    both = sorted(set(named) & set(qconfig.get("ignore") or []))
    if both:
        problems.append(f"{both[0]} is in both targets and ignore")
    return fmt


def _modules(checkpoint: Checkpoint, fmt: str) -> tuple[set[str], list[str]]:
    """Quantized modules (those holding the format's first stored tensor) and every
    weight-holding module, in checkpoint order."""
    stored = FORMATS[fmt].stored
    holders, quantized = {}, set()
    for name, info in checkpoint.tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "weight" or suffix in stored:
            holders[module] = None
        if suffix == stored[0] and (fmt != "fp8" or info.dtype == "F8_E4M3"):
            quantized.add(module)
    return quantized, list(holders)


def _check_accounting(holders, quantized, targets, ignore, report: VerifyReport) -> None:
    for module in holders:
        ignored = any(matches_ignore(p, module) for p in ignore)
        if module in quantized and ignored:
            report.problems.append(f"{module} is quantized but listed in ignore")
        if module in quantized and "Linear" not in targets and not any(
            matches_ignore(t, module) for t in targets
        ):
            report.problems.append(f"{module} is quantized but matches no config group target")
        if module not in quantized and not ignored:
            report.problems.append(f"{module} holds an unquantized weight but is not in ignore")


def _check_stored(checkpoint: Checkpoint, fmt: str, quantized, report: VerifyReport) -> set[str]:
    """Every quantized module has its format's stored tensors, with the right dtypes and
    shapes; returns the modules that do not."""
    spec = FORMATS[fmt]
    tensors = checkpoint.tensor_shard
    malformed = set()
    for module in [m for m in checkpoint_modules(checkpoint) if m in quantized]:
        missing = [s for s in spec.stored if f"{module}.{s}" not in tensors]
        if missing:
            report.problems.append(f"{module}: stored tensor {module}.{missing[0]} missing")
            malformed.add(module)
            continue
        infos = {s: checkpoint.info(f"{module}.{s}") for s in spec.stored}
        for suffix, (dtype, shape) in _expected(fmt, infos).items():
            info = infos[suffix]
            if info.dtype not in dtype or list(info.shape) != shape:
                report.problems.append(
                    f"{module}.{suffix}: stored {info.dtype} {list(info.shape)}, expected "
                    f"{'/'.join(dtype)} {shape}")
                malformed.add(module)
    return malformed


def checkpoint_modules(checkpoint: Checkpoint) -> list[str]:
    return list(dict.fromkeys(n.rpartition(".")[0] for n in checkpoint.tensor_shard))


def _expected(fmt: str, infos) -> dict[str, tuple[tuple[str, ...], list[int]]]:
    """The dtype(s) and shape each stored tensor must have, from the first one's shape."""
    floats = ("BF16", "F16", "F32")
    if fmt == "fp8":
        n, k = infos["weight"].shape
        return {"weight": (("F8_E4M3",), [n, k]), "weight_scale": (floats, [n, 1])}
    n, half_k = infos["weight_packed"].shape
    groups = 2 * half_k // FORMATS[fmt].block_size
    if fmt == "mxfp4":
        return {"weight_packed": (("U8",), [n, half_k]), "weight_scale": (("U8",), [n, groups])}
    return {"weight_packed": (("U8",), [n, half_k]),
            "weight_scale": (("F8_E4M3",), [n, groups]),
            "weight_global_scale": (("F32",), [1])}


def _check_fused(checkpoint: Checkpoint, fmt: str, holders, quantized, report) -> None:
    for group in fused_groups(holders):
        inside = [m for m in group.members if m in quantized]
        if inside and len(inside) != len(group.members):
            outside = [m for m in group.members if m not in quantized]
            report.problems.append(f"fused group {group.label} is split: quantized "
                                   f"{', '.join(inside)}; not quantized {', '.join(outside)}")
            continue
        if inside and fmt == "nvfp4":
            names = [f"{m}.weight_global_scale" for m in group.members]
            if not all(n in checkpoint.tensor_shard for n in names):
                continue
            readers = {}
            values = []
            for n in names:
                shard = checkpoint.tensor_shard[n]
                readers.setdefault(shard, ShardReader(checkpoint.shards[shard]))
                values.append(readers[shard].tensor(n).item())
            if len(set(values)) != 1:
                report.problems.append(f"fused group {group.label} has different NVFP4 global "
                                       f"scales {values}; vLLM needs one shared scale")


def _check_round_trip(checkpoint: Checkpoint, fmt: str, quantized, report) -> None:
    """Dequantize every quantized weight (in row chunks) and require finite values."""
    readers = {s: ShardReader(h) for s, h in checkpoint.shards.items()}
    for module in [m for m in checkpoint_modules(checkpoint) if m in quantized]:
        parts = {s: (checkpoint.tensor_shard[f"{module}.{s}"], f"{module}.{s}")
                 for s in FORMATS[fmt].stored}
        n, width = checkpoint.info(parts[FORMATS[fmt].stored[0]][1]).shape
        step = max(1, ROWS_PER_CHECK // max(1, width))
        for start in range(0, n, step):
            rows = slice(start, min(n, start + step))
            stored = {s: readers[shard].tensor(name, None if s == "weight_global_scale" else rows)
                      for s, (shard, name) in parts.items()}
            if not torch.isfinite(dequantize(fmt, stored).float()).all():
                report.problems.append(f"{module}: dequantized weight has non-finite values "
                                       f"(rows {start}..{rows.stop - 1})")
                break
            for s, (shard, name) in parts.items():
                readers[shard].release(name, None if s == "weight_global_scale" else rows)
