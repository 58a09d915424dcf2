"""``verify_checkpoint``: what vLLM would otherwise find at load time (docs/quantize.md,
"qstream verify"; docs/vllm.md), replayed per runtime Linear layer for a draft, and
:func:`checks_run`, what one run covered (docs/guarantees.md: "OK" never hides a skipped check).
Malformed files raise QStreamError when the checkpoint is opened; the rest is a list of problems."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qstream.checkpoint.files import Checkpoint, open_checkpoint
from qstream.checkpoint.integrity import Integrity, check_integrity
from qstream.checkpoint.layout import (
    KV_CACHE_SCHEME,
    KV_SCALES,
    activations_of,
    format_of_layout,
    input_scale_name,
)
from qstream.errors import QStreamError
from qstream.formats import FORMATS, get_format
from qstream.formats.format import finite_positive
from qstream.publish import QUANTIZE_RECORD
from qstream.serving import ACTIVATIONS
from qstream.vllm import profiles as serving
from qstream.vllm.profiles import Profile, RuntimeModule, fused_groups, matches, profile_for
from qstream.vllm.shapes import d2t_problems, shape_problems

ROWS_PER_CHECK = 1 << 21  # elements dequantized at a time


@dataclass
class VerifyReport:
    directory: str
    quant_format: str | None = None
    activations: str = "none"  # how the quantized linears' inputs are served (ACTIVATIONS)
    modules_quantized: list[str] = field(default_factory=list)
    modules_ignored: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    serving_profile: str = serving.GENERIC
    served_class: str = ""  # the class vLLM serves the profile's architecture as ("": generic)
    target_layers: int | None = None  # L used for the draft's runtime names
    tensor_parallel_size: int = 1
    # vLLM's decision per runtime Linear layer: {"module", "shards", "scheme", "why"}
    runtime_modules: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what only some vLLM versions refuse
    # every check, whether it ran, and what it found or why not (checks_run)
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
    (L, which offsets a draft's runtime layer names) defaults to config.json's
    ``target_num_hidden_layers``; ``deep`` also dequantizes every quantized weight."""
    if tensor_parallel_size < 1:
        raise QStreamError(f"--tensor-parallel-size {tensor_parallel_size}: must be at least 1")
    checkpoint = open_checkpoint(directory)
    report = VerifyReport(str(checkpoint.directory), tensor_parallel_size=tensor_parallel_size)
    profile = profile_for(checkpoint.config)
    report.serving_profile, report.served_class = profile.name, profile.served_class
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
        replay_vllm(checkpoint, fmt, profile, holders, quantized, targets, ignore, report)
    else:
        _check_accounting(holders, quantized, targets, ignore, report)
    stored = {n: tuple(i.shape) for n, i in checkpoint.tensors.items()}
    report.problems += shape_problems(profile, checkpoint.config, stored, fmt, quantized)
    malformed = _check_stored(checkpoint, fmt, quantized, report)
    _check_fused(checkpoint, fmt, profile, holders, quantized, report)
    integrity = check_integrity(checkpoint)  # every file quantize recorded, unchanged
    report.problems += [m.problem() for m in integrity.mismatches]
    report.integrity = integrity.to_json()
    sound = [m for m in quantized if m not in malformed]
    _check_scales(checkpoint, fmt, sound, report)
    _check_serving(checkpoint, qconfig, profile, sound, report)
    if deep:
        _check_round_trip(checkpoint, fmt, sound, report)
    report.checks = checks_run(fmt, profile, len(report.runtime_modules), deep, integrity)
    return report


def draft_target_layers(checkpoint: Checkpoint, given: int | None) -> int:
    if given is not None:
        if given < 0:
            raise QStreamError(f"--target-layers {given}: must be at least 0")
        return given
    value = serving.target_layers_of(checkpoint.config)
    if value is None:
        raise QStreamError(
            f"{checkpoint.directory / 'config.json'}: no integer target_num_hidden_layers; pass "
            "the target checkpoint (--target DIR) or its layer count (--target-layers L)"
        )
    return value


def _check_config(qconfig: dict, report: VerifyReport) -> str | None:
    problems = report.problems
    for key, want in (
        ("quant_method", "compressed-tensors"),
        ("quantization_status", "compressed"),
    ):
        if qconfig.get(key) != want:
            problems.append(f"{key} is {qconfig.get(key)!r}, not {want!r}")
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
    _check_activations(group, fmt, report)
    both = sorted(set(group.get("targets") or []) - {"Linear"} & set(qconfig.get("ignore") or []))
    if both:
        problems.append(f"{both[0]} is in both targets and ignore")
    return fmt


def _check_activations(group: dict, fmt: str, report: VerifyReport) -> None:
    activations = activations_of(FORMATS[fmt], group.get("input_activations"))
    if activations is None:
        served = [a.name for a in ACTIVATIONS.values() if fmt in a.weights]
        report.problems.append(
            f"config group input_activations {group.get('input_activations')!r} is not a scheme "
            f"qstream writes beside {fmt} weights (none, {', '.join(served)})"
        )
    else:
        report.activations = activations.name
    if group.get("output_activations"):
        report.problems.append("config group quantizes output activations; vLLM serves none")


def _modules(checkpoint: Checkpoint, fmt: str) -> tuple[dict[str, None], list[str]]:
    """Quantized modules (those holding the format's first stored tensor) and every
    weight-holding module, in checkpoint order."""
    holders: dict[str, None] = {}
    marked: set[str] = set()
    for name, info in checkpoint.tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "weight" or suffix in FORMATS[fmt].stored:
            holders[module] = None
        if FORMATS[fmt].marks_quantized(suffix, info.dtype):
            marked.add(module)
    modules = dict.fromkeys(n.rpartition(".")[0] for n in checkpoint.tensor_shard)
    return {m: None for m in modules if m in marked}, list(holders)


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
    """Every quantized module has its format's stored tensors, with the dtypes and shapes the
    first one's shape implies; returns the modules that do not."""
    spec = FORMATS[fmt]
    malformed = set()
    for module in quantized:
        missing = [s for s in spec.stored if f"{module}.{s}" not in checkpoint.tensor_shard]
        if missing:
            report.problems.append(f"{module}: stored tensor {module}.{missing[0]} missing")
            malformed.add(module)
            continue
        infos = {s: checkpoint.info(f"{module}.{s}") for s in spec.stored}
        n, width = infos[spec.stored[0]].shape
        for suffix, shape in spec.stored_shapes(n, width * spec.codes_per_byte).items():
            info, dtype = infos[suffix], spec.accepted_dtypes(suffix)
            if info.dtype not in dtype or list(info.shape) != list(shape):
                report.problems.append(
                    f"{module}.{suffix}: stored {info.dtype} {list(info.shape)}, expected "
                    f"{'/'.join(dtype)} {list(shape)}"
                )
                malformed.add(module)
    return malformed


def _check_fused(
    checkpoint: Checkpoint, fmt: str, profile: Profile, holders, quantized, report
) -> None:
    shared = FORMATS[fmt].global_scale
    for group in fused_groups(holders, profile):
        inside = [m for m in group.members if m in quantized]
        if inside and len(inside) != len(group.members):
            outside = [m for m in group.members if m not in quantized]
            report.problems.append(
                f"fused group {group.label} is split: quantized {_few(inside)}; not quantized "
                f"{_few(outside)} (all or none: {group.rule})"
            )
            continue
        names = [f"{m}.{shared}" for m in group.members]
        if not (inside and shared and all(n in checkpoint.tensor_shard for n in names)):
            continue
        values = {checkpoint.tensor(n).item() for n in names}
        if len(values) != 1:
            report.problems.append(
                f"fused group {group.label} has {len(values)} different NVFP4 global scales "
                f"{sorted(values)}; vLLM keeps one per fused layer (the largest) and "
                "dequantizes the other members wrongly"
            )


def _few(modules: list[str], limit: int = 4) -> str:
    shown = ", ".join(modules[:limit])
    return shown + (f" and {len(modules) - limit} more" if len(modules) > limit else "")


def _check_scales(checkpoint: Checkpoint, fmt: str, quantized, report) -> None:
    """Each format's ``bad_scales`` (docs/quantize.md, "qstream verify"), and a draft's d2t."""
    report.problems += d2t_problems(checkpoint)
    spec = FORMATS[fmt]
    for name in [f"{m}.{s}" for m in quantized for s in spec.scales]:
        value, bad, what = spec.bad_scales(checkpoint.tensor(name))
        if bool(bad.any()):
            report.problems.append(
                f"{name}: {int(bad.sum())} value(s) {what}, e.g. {value[bad][0].item()} "
                f"(in {checkpoint.tensor_shard[name]})"
            )
        checkpoint.release(name)


def _check_serving(
    checkpoint: Checkpoint, qconfig: dict, profile: Profile, quantized, report: VerifyReport
) -> None:
    """What a static activation or KV-cache scheme stores (docs/quantize.md, "Activation and
    KV-cache schemes"), finite and positive, and its calibration in the record.  A missing input
    scale is loaded silently wrong by vLLM 0.32.0: the parameter keeps what ``create_weights``
    left, float32's lowest value for FP8, uninitialised memory for NVFP4."""
    scales: list[str] = []
    stored = input_scale_name(ACTIVATIONS[report.activations])
    for module in quantized if stored else []:
        scales.append(f"{module}.{stored}")
        if scales[-1] not in checkpoint.tensor_shard:
            report.problems.append(
                f"{module}: {stored} missing ({report.activations} activations need one per "
                "quantized module; vLLM 0.32.0 would load the layer silently wrong)"
            )
    kv = qconfig.get("kv_cache_scheme")
    if kv is not None:
        scales += _check_kv(checkpoint, kv, profile, report)
    present = [n for n in scales if n in checkpoint.tensor_shard]
    for name in present:
        value, bad, what = finite_positive(checkpoint.tensor(name))
        if bool(bad.any()):
            report.problems.append(f"{name}: value {value[bad][0].item()} {what}")
    recorded = _recorded_calibration(checkpoint) if present else True
    if recorded is False:
        report.problems.append(
            f"{QUANTIZE_RECORD}: no calibration (source and size) recorded for the stored "
            f"scales, e.g. {present[0]}"
        )
    elif recorded is None:
        report.warnings.append(
            f"no {QUANTIZE_RECORD}: nothing records the calibration the stored scales (e.g. "
            f"{present[0]}) were measured on"
        )


def _check_kv(checkpoint: Checkpoint, kv: object, profile: Profile, report) -> list[str]:
    """Returns the scale tensors the scheme expects."""
    if kv != KV_CACHE_SCHEME:
        report.problems.append(f"kv_cache_scheme {kv!r} is not {KV_CACHE_SCHEME!r}")
    ignored = serving.KV_SCALES_NOT_LOADED.get(profile.name)
    if ignored:
        report.warnings.append(f"kv_cache_scheme: {ignored}; scale 1.0 is what will be served")
        stored = [n for n in checkpoint.tensor_shard if n.rpartition(".")[2] in KV_SCALES]
        report.problems += [f"{n}: {ignored}" for n in stored]
        return []
    expected = [f"{layer}.{s}" for layer in checkpoint.attention_layers for s in KV_SCALES]
    report.problems += [
        f"{n}: missing (kv_cache_scheme fp8 needs k_scale and v_scale per attention layer; "
        "vLLM serves 1.0 in its place)"
        for n in expected
        if n not in checkpoint.tensor_shard
    ]
    return expected


def _recorded_calibration(checkpoint: Checkpoint) -> bool | None:
    """Whether quantize's record names the calibration's set and size (None: no record)."""
    path = checkpoint.directory / QUANTIZE_RECORD
    if not path.is_file():
        return None
    try:
        serving_record = json.loads(path.read_text())["summary"].get("serving", {})
    except (ValueError, KeyError, AttributeError):
        return False  # the sha256 check names an unreadable record
    calibration = serving_record.get("calibration")
    # qstream.calibration.Calibration.source: how it was drawn, and the size it was measured on
    size = ("blocks", "tokens")
    return (
        isinstance(calibration, dict)
        and "drawn" in calibration
        and all(isinstance(calibration.get(k), int) and calibration[k] > 0 for k in size)
    )


def _check_round_trip(checkpoint: Checkpoint, fmt: str, quantized, report) -> None:
    spec = FORMATS[fmt]
    for module in quantized:
        n, width = checkpoint.info(f"{module}.{spec.stored[0]}").shape
        step = max(1, ROWS_PER_CHECK // max(1, width))
        for start in range(0, n, step):
            rows = slice(start, min(n, start + step))
            parts = {s: None if s == spec.global_scale else rows for s in spec.stored}
            stored = {s: checkpoint.tensor(f"{module}.{s}", r) for s, r in parts.items()}
            if not torch.isfinite(spec.dequantize(stored).float()).all():
                report.problems.append(
                    f"{module}: dequantized weight has non-finite values "
                    f"(rows {start}..{rows.stop - 1})"
                )
                break
            for s, r in parts.items():
                checkpoint.release(f"{module}.{s}", r)


def matches_ignore(entry: str, module: str) -> bool:
    """compressed-tensors / vLLM semantics for ignore entries: equal, or ``re:`` regex."""
    return matches(entry, module) if entry.startswith("re:") else entry == module


def replay_vllm(
    checkpoint: Checkpoint,
    fmt: str,
    profile: Profile,
    holders: list[str],
    quantized: dict[str, None],
    targets: list,
    ignore: list,
    report: VerifyReport,
) -> None:
    """vLLM's decision for every runtime Linear layer of the draft (docs/vllm.md) against what
    the checkpoint stores for each of its shards; and the modules vLLM never quantizes."""
    expects = ", ".join(FORMATS[fmt].stored)
    for rt in serving.runtime_modules(profile, holders, report.target_layers or 0):
        scheme, why = _vllm_scheme(rt, fmt, targets, ignore)
        report.runtime_modules.append(
            {"module": rt.name, "shards": list(rt.shards), "scheme": scheme, "why": why}
        )
        for shard in rt.shards:
            name = f"{shard}.weight"
            if scheme is not None and shard not in quantized:
                have = (
                    f"{checkpoint.info(name).dtype} {list(checkpoint.info(name).shape)} {name}"
                    if name in checkpoint.tensor_shard
                    else "no weight"
                )
                report.problems.append(
                    f"{rt.name}: vLLM builds it {fmt} ({why}) and expects {shard}.{{{expects}}}, "
                    f"but the checkpoint has {have}"
                )
            elif scheme is None and shard in quantized:
                report.problems.append(
                    f"{rt.name}: vLLM builds it unquantized ({why}) and expects {name} in "
                    f"the base dtype, but the checkpoint stores {shard}.{{{expects}}}"
                )
    for module in holders:
        never = serving.never_quantized(profile, module)
        if never and module in quantized:
            report.problems.append(
                f"{module}: stored {fmt}, but vLLM never quantizes it "
                f"({never}); it must keep the base dtype"
            )
        head = serving.head_problem(profile, module, fmt, checkpoint.config)
        if head and module in quantized:
            report.problems.append(f"{module}: stored {fmt}, but {head}")
    _replay_tp(checkpoint, fmt, profile, holders, quantized, report)


def _replay_tp(
    checkpoint: Checkpoint, fmt: str, profile: Profile, holders, quantized, report
) -> None:
    """What vLLM 0.32.0 does with the draft at the tensor-parallel size (docs/vllm.md): it
    cannot build a draft whose heads or split dimensions do not divide by it, and it gives an
    FP4 row-parallel shard that is not a whole number of blocks the wrong block scales."""
    tp, spec = report.tensor_parallel_size, FORMATS[fmt]
    shapes: dict[str, tuple[int, ...]] = {}
    for module in holders:  # [N, K] as vLLM sizes the layer (packed codes unpacked)
        packed = module in quantized and spec.codes_per_byte > 1
        name = f"{module}.{spec.stored[0] if packed else 'weight'}"
        shape = tuple(checkpoint.info(name).shape) if name in checkpoint.tensor_shard else ()
        shapes[module] = (shape[0], shape[1] * spec.codes_per_byte) if packed and shape else shape
    cannot = serving.tp_build_problem(profile, checkpoint.config, shapes, tp)
    if cannot:
        report.problems.append(
            f"vLLM 0.32.0 cannot build the draft at tensor_parallel_size {tp}: {cannot}"
        )
        return
    for module in holders:
        shape = shapes[module]
        wrong = (
            serving.tp_scale_problem(profile, module, shape[1], spec.block_size, tp)
            if module in quantized and len(shape) == 2
            else None
        )
        if wrong:
            report.problems.append(f"{module}: stored {fmt}, but {wrong}")


def _vllm_scheme(
    rt: RuntimeModule, fmt: str, targets: list, ignore: list
) -> tuple[str | None, str]:
    """compressed-tensors in vLLM: a Linear layer is ignored iff an ignore entry equals its
    name or is ``re:`` + a regex that re.match-es it; otherwise it takes the group's scheme if a
    target names its class ("Linear" matches every Linear class) or matches its name."""
    hit = next((e for e in ignore if matches_ignore(e, rt.quant_name)), None)
    if hit is not None:
        return None, f"ignore entry {hit!r} matches {rt.quant_name}"
    if ("Linear" in targets and rt.linear) or any(
        matches_ignore(t, rt.quant_name) for t in targets
    ):
        return fmt, f"no ignore entry matches {rt.quant_name}"
    if not rt.linear:  # CompressedTensorsConfig.get_quant_method, find_matched_target
        return None, f"no config group target names the ParallelLMHead {rt.quant_name}"
    return None, f"no config group target matches {rt.quant_name}"


CHECKS = ("config", "tensors", "vllm_rules", "fused_groups", "sha256", "scales", "round_trip")
VLLM_LOADER = "vllm_loader"  # run by ``verify --vllm`` (qstream/commands/verify.py)


def _check(ran: bool, detail: str) -> dict:
    return {"ran": ran, "detail": detail}


def checks_run(
    fmt: str | None,
    profile: Profile,
    runtime_layers: int,
    deep: bool,
    integrity: Integrity | None,
) -> dict[str, dict]:
    """Every check of :func:`verify_checkpoint`, in order, plus vLLM's own loader (not run
    unless ``--vllm``).  ``fmt`` None: nothing after the config was reached."""
    if fmt is None or integrity is None:
        skipped = _check(False, "not reached: quantization_config names no format qstream checks")
        checks = {name: skipped for name in CHECKS}
        return {**checks, "config": _check(True, "quantization_config"), VLLM_LOADER: skipped}
    if profile.renames_layers:
        rules = f"vLLM's decision replayed for {runtime_layers} runtime Linear layers"
    else:
        rules = "each weight-holding module quantized or ignored (no serving profile to replay)"
    if integrity.skipped is not None:
        sha256 = _check(
            False,
            f"{integrity.skipped}: byte-level integrity not checked; a changed weight byte "
            "that still decodes to a finite value is not detected",
        )
    else:
        differ = len(integrity.mismatches)
        found = f"{differ} differ from" if differ else "match"
        sha256 = _check(True, f"{integrity.files} files {found} {QUANTIZE_RECORD}")
    return {
        "config": _check(True, f"one config group, {fmt} weight arguments, weight-only"),
        "tensors": _check(True, "stored dtypes and shapes of every quantized module, the index"),
        "vllm_rules": _check(True, rules),
        "fused_groups": _check(True, "all members or none quantized; NVFP4: one global scale"),
        "sha256": sha256,
        "scales": _check(True, get_format(fmt).scales_checked),
        "round_trip": _check(True, "every quantized weight dequantized to finite values")
        if deep
        else _check(False, "--deep not given"),
        VLLM_LOADER: _check(False, "--vllm not given"),
    }
