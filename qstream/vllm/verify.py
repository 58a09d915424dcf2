"""``verify_checkpoint``: the checks of a quantized checkpoint that vLLM would otherwise
discover at load time (docs/quantize.md, docs/vllm.md), plus a dequantize round trip.

For an architecture with a serving profile (the K3 DSpark draft), verify replays vLLM's decision
for every Linear layer vLLM builds, under its runtime name: scheme or no scheme (ignore entries
matched exactly or as ``re:`` regexes), the parameters that scheme expects, and whether the
checkpoint provides exactly those; plus the profile's fused and cross-layer groups, modules vLLM
never quantizes and the tensor-parallel rules.  For every profile, the tensors are checked
against config.json as quantize checks its input (:mod:`qstream.vllm.shapes`).

Malformed files (bad header, inconsistent index) raise QStreamError when the checkpoint is
opened; everything else is collected as a list of problems, empty for a good checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from qstream.checkpoint.files import Checkpoint, open_checkpoint
from qstream.checkpoint.integrity import Integrity, check_integrity
from qstream.checkpoint.layout import format_of_layout
from qstream.checkpoint.safetensors_io import ShardReader
from qstream.errors import QStreamError
from qstream.formats import FORMATS
from qstream.vllm import profiles as serving
from qstream.vllm.profiles import Profile, fused_groups, profile_for
from qstream.vllm.replay import Replay, draft_target_layers, matches_ignore, replay_vllm
from qstream.vllm.scope import checks_run
from qstream.vllm.shapes import d2t_problems, shape_problems

ROWS_PER_CHECK = 1 << 21  # elements dequantized at a time


@dataclass
class VerifyReport:
    directory: str
    quant_format: str | None = None
    modules_quantized: list[str] = field(default_factory=list)
    modules_ignored: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    serving_profile: str = serving.GENERIC
    target_layers: int | None = None  # L used for the draft's runtime names
    tensor_parallel_size: int = 1
    # vLLM's decision per runtime Linear layer: {"module", "shards", "scheme", "why"}
    runtime_modules: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what only some vLLM versions refuse
    # every check, whether it ran, and what it found or why not (scope.py)
    checks: dict[str, dict] = field(default_factory=dict)
    integrity: dict = field(default_factory=dict)  # the sha256 check (integrity.py)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(
    directory: str | Path,
    tensor_parallel_size: int = 1,
    target_layers: int | None = None,
    deep: bool = False,
) -> VerifyReport:
    """Check ``directory`` as vLLM will load it at ``tensor_parallel_size``.  ``target_layers``
    (L, the target's layer count, which offsets a draft's runtime layer names) defaults to
    config.json's ``target_num_hidden_layers``.  Every scale is checked for sane values;
    ``deep`` also dequantizes every quantized weight."""
    if tensor_parallel_size < 1:
        raise QStreamError(f"--tensor-parallel-size {tensor_parallel_size}: must be at least 1")
    checkpoint = open_checkpoint(directory)
    report = VerifyReport(str(checkpoint.directory), tensor_parallel_size=tensor_parallel_size)
    profile = profile_for(checkpoint.config)
    report.serving_profile = profile.name
    qconfig = checkpoint.config.get("quantization_config")
    if not isinstance(qconfig, dict):
        raise QStreamError(
            f"{checkpoint.directory}: config.json has no quantization_config; "
            "not a quantized checkpoint"
        )
    fmt = _check_config(qconfig, report)
    if fmt is None:
        report.checks = checks_run(None, profile, 0, deep, None)
        return report
    report.quant_format = fmt
    quantized, holders = _modules(checkpoint, fmt)
    report.modules_quantized = [m for m in holders if m in quantized]
    ignore = qconfig.get("ignore") or []
    report.modules_ignored = [m for m in holders if any(matches_ignore(p, m) for p in ignore)]
    targets = next(iter(qconfig["config_groups"].values())).get("targets") or []
    if profile.renames_layers:
        report.target_layers = draft_target_layers(checkpoint, target_layers)
        replay = Replay(report.target_layers, tensor_parallel_size)
        replay_vllm(checkpoint, fmt, profile, holders, quantized, (targets, ignore), replay)
        report.runtime_modules = replay.runtime_modules
        report.problems += replay.problems
    else:
        _check_accounting(holders, quantized, targets, ignore, report)
    stored = {n: tuple(i.shape) for n, i in checkpoint.tensors.items()}
    report.problems += shape_problems(profile, checkpoint.config, stored, fmt, quantized)
    malformed = _check_stored(checkpoint, fmt, quantized, report)
    _check_fused(checkpoint, fmt, profile, holders, quantized, report)
    integrity = _check_digests(checkpoint, report)
    _check_scales(checkpoint, fmt, quantized - malformed, report)
    if deep:
        _check_round_trip(checkpoint, fmt, quantized - malformed, report)
    report.checks = checks_run(fmt, profile, len(report.runtime_modules), deep, integrity)
    return report


def _check_config(qconfig: dict, report: VerifyReport) -> str | None:
    problems = report.problems
    if qconfig.get("quant_method") != "compressed-tensors":
        problems.append(
            f"quant_method is {qconfig.get('quant_method')!r}, not 'compressed-tensors'"
        )
    if qconfig.get("quantization_status") != "compressed":
        problems.append(
            f"quantization_status is {qconfig.get('quantization_status')!r}, not 'compressed'"
        )
    groups = qconfig.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        problems.append(
            f"expected exactly one config group, found "
            f"{len(groups) if isinstance(groups, dict) else 'none'}"
        )
        return None
    group = next(iter(groups.values()))
    fmt = format_of_layout(qconfig.get("format", ""))
    if fmt is None:
        problems.append(
            f"format {qconfig.get('format')!r} is not one qstream writes "
            f"({', '.join(s.layout for s in FORMATS.values())})"
        )
        return None
    if group.get("format", qconfig.get("format")) != qconfig.get("format"):
        problems.append(
            f"config group format {group.get('format')!r} differs from {qconfig.get('format')!r}"
        )
    weights = group.get("weights") or {}
    for key, value in FORMATS[fmt].weights_args.items():
        if weights.get(key) != value:
            problems.append(
                f"config group weights.{key} is {weights.get(key)!r}, the "
                f"{FORMATS[fmt].layout} format needs {value!r}"
            )
    if group.get("input_activations") or group.get("output_activations"):
        problems.append("config group quantizes activations; qstream checkpoints are weight-only")
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
    holders: dict[str, None] = {}
    quantized: set[str] = set()
    for name, info in checkpoint.tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "weight" or suffix in stored:
            holders[module] = None
        if FORMATS[fmt].marks_quantized(suffix, info.dtype):
            quantized.add(module)
    return quantized, list(holders)


def _check_accounting(holders, quantized, targets, ignore, report: VerifyReport) -> None:
    for module in holders:
        ignored = any(matches_ignore(p, module) for p in ignore)
        if module in quantized and ignored:
            report.problems.append(f"{module} is quantized but listed in ignore")
        if (
            module in quantized
            and "Linear" not in targets
            and not any(matches_ignore(t, module) for t in targets)
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
                    f"{'/'.join(dtype)} {shape}"
                )
                malformed.add(module)
    return malformed


def checkpoint_modules(checkpoint: Checkpoint) -> list[str]:
    return list(dict.fromkeys(n.rpartition(".")[0] for n in checkpoint.tensor_shard))


def _expected(fmt: str, infos) -> dict[str, tuple[tuple[str, ...], list[int]]]:
    """The dtype(s) and shape each stored tensor must have, from the first one's shape."""
    spec = FORMATS[fmt]
    n, width = infos[spec.stored[0]].shape
    k = width * spec.codes_per_byte
    return {s: (spec.accepted_dtypes(s), list(v)) for s, v in spec.stored_shapes(n, k).items()}


def _check_fused(
    checkpoint: Checkpoint, fmt: str, profile: Profile, holders, quantized, report
) -> None:
    for group in fused_groups(holders, profile):
        inside = [m for m in group.members if m in quantized]
        if inside and len(inside) != len(group.members):
            outside = [m for m in group.members if m not in quantized]
            report.problems.append(
                f"fused group {group.label} is split: quantized "
                f"{_few(inside)}; not quantized {_few(outside)} "
                f"(all or none: {group.rule})"
            )
            continue
        shared = FORMATS[fmt].global_scale
        if inside and shared:
            names = [f"{m}.{shared}" for m in group.members]
            if not all(n in checkpoint.tensor_shard for n in names):
                continue
            readers: dict[str, ShardReader] = {}
            values = []
            for n in names:
                shard = checkpoint.tensor_shard[n]
                readers.setdefault(shard, ShardReader(checkpoint.shards[shard]))
                values.append(readers[shard].tensor(n).item())
            if len(set(values)) != 1:
                report.problems.append(
                    f"fused group {group.label} has {len(set(values))} "
                    f"different NVFP4 global scales {sorted(set(values))}; "
                    "vLLM keeps one per fused layer (the largest) and "
                    "dequantizes the other members wrongly"
                )


def _check_digests(checkpoint: Checkpoint, report: VerifyReport) -> Integrity:
    """Every file quantize recorded (sha256 in its record) is present and unchanged."""
    integrity = check_integrity(checkpoint)
    report.problems += [m.problem() for m in integrity.mismatches]
    report.integrity = integrity.to_json()
    return integrity


def _check_scales(checkpoint: Checkpoint, fmt: str, quantized, report) -> None:
    """Value-level sanity of what the kernels divide or multiply by: each format's
    ``bad_scales`` (docs/quantize.md, "qstream verify"); and of a draft's d2t index map."""
    report.problems += d2t_problems(checkpoint)
    readers = {s: ShardReader(h) for s, h in checkpoint.shards.items()}
    spec = FORMATS[fmt]
    for module in [m for m in checkpoint_modules(checkpoint) if m in quantized]:
        for suffix in spec.scales:
            name = f"{module}.{suffix}"
            shard = checkpoint.tensor_shard[name]
            value = readers[shard].tensor(name)
            value, bad, what = spec.bad_scales(value)
            if bool(bad.any()):
                first = value[bad][0].item()
                report.problems.append(
                    f"{name}: {int(bad.sum())} value(s) {what}, e.g. {first} (in {shard})"
                )
            readers[shard].release(name, None)


def _check_round_trip(checkpoint: Checkpoint, fmt: str, quantized, report) -> None:
    """Dequantize every quantized weight (in row chunks) and require finite values."""
    spec = FORMATS[fmt]
    readers = {s: ShardReader(h) for s, h in checkpoint.shards.items()}
    for module in [m for m in checkpoint_modules(checkpoint) if m in quantized]:
        parts = {
            s: (checkpoint.tensor_shard[f"{module}.{s}"], f"{module}.{s}") for s in spec.stored
        }
        n, width = checkpoint.info(f"{module}.{spec.stored[0]}").shape
        step = max(1, ROWS_PER_CHECK // max(1, width))
        for start in range(0, n, step):
            rows = slice(start, min(n, start + step))
            stored = {
                s: readers[shard].tensor(name, None if s == spec.global_scale else rows)
                for s, (shard, name) in parts.items()
            }
            if not torch.isfinite(spec.dequantize(stored).float()).all():
                report.problems.append(
                    f"{module}: dequantized weight has non-finite values "
                    f"(rows {start}..{rows.stop - 1})"
                )
                break
            for s, (shard, name) in parts.items():
                readers[shard].release(name, None if s == spec.global_scale else rows)


def _few(modules: list[str], limit: int = 4) -> str:
    shown = ", ".join(modules[:limit])
    return shown + (f" and {len(modules) - limit} more" if len(modules) > limit else "")
