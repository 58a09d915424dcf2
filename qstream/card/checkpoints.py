"""What the shipped checkpoints are (docs/card.md): size, what is quantized to what, why the rest
is kept, and the command, read from the directories (quantize's record ``qstream_quantize.json``:
``{"command", "summary", "qstream_version"}``; without one the command is reconstructed)."""

from __future__ import annotations

import json
import shlex
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from qstream.card.document import Code, Part
from qstream.checkpoint.files import Checkpoint, open_checkpoint
from qstream.checkpoint.inspect import inspect_checkpoint, module_kind
from qstream.checkpoint.integrity import NO_CHECK_FLAG, integrity_record
from qstream.checkpoint.layout import format_of_layout
from qstream.errors import QStreamError
from qstream.formats import get_format
from qstream.publish import QUANTIZE_RECORD as PROVENANCE
from qstream.quant.select import HEAD_NAMES, is_embedding, select_modules, weight_modules
from qstream.tablefit import Cell, Table
from qstream.units import GIB
from qstream.vllm.profiles import fused_groups, never_quantized, profile_for

PACKED = "weight_packed"  # two 4-bit weights per stored byte


@dataclass
class CheckpointFacts:
    path: Path
    fmt: str | None  # None for the unquantized base
    size_bytes: int
    params_total: int  # logical parameters (inspect's count: packed bytes count twice)
    params_quantized: int
    quantized: list[str] = field(default_factory=list)  # module names
    kept: dict[str, tuple[tuple[int, ...], int, str]] = field(default_factory=dict)
    # module -> (weight shape, parameters, why it is not quantized)
    command: str | None = None
    command_origin: str = ""  # a sentence: recorded, or how it was reconstructed
    integrity: dict = field(default_factory=dict)  # the sha256 check (checkpoint/integrity.py)


def read_base(directory: str | Path) -> CheckpointFacts:
    info = inspect_checkpoint(directory)
    if info["quantization_config"] is not None:
        raise QStreamError(
            f"--base {directory}: already quantized (config.json has a "
            "quantization_config); give the checkpoint it was made from"
        )
    return CheckpointFacts(Path(directory), None, info["bytes"], info["params"], 0)


def read_quantized(
    directory: str | Path, base: CheckpointFacts | None, integrity_check: bool = True
) -> CheckpointFacts:
    """Size, selection, reasons and command of one quantized checkpoint."""
    directory = Path(directory)
    checkpoint = open_checkpoint(directory)
    qconfig = checkpoint.config.get("quantization_config")
    fmt = format_of_layout(qconfig.get("format", "")) if isinstance(qconfig, dict) else None
    if fmt is None:
        raise QStreamError(
            f"--checkpoint {directory}: not a qstream/compressed-tensors "
            "weight-only checkpoint (config.json has no quantization_config "
            "of fp8, mxfp4 or nvfp4 format)"
        )
    integrity = integrity_record(directory, f"--checkpoint {directory}", integrity_check)
    tensors = checkpoint.tensors
    quantized = [
        name[: -len(".weight_scale")] for name in tensors if name.endswith(".weight_scale")
    ]
    params_quantized = sum(
        2 * tensors[f"{m}.{PACKED}"].numel
        if f"{m}.{PACKED}" in tensors
        else tensors[f"{m}.weight"].numel
        for m in quantized
    )
    path, provenance = directory / PROVENANCE, None
    if path.exists():
        try:
            provenance = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise QStreamError(f"{path}: unreadable provenance file ({exc})") from exc
        if not isinstance(provenance, dict) or not isinstance(provenance.get("command"), str):
            raise QStreamError(f'{path}: provenance file without a "command" string')
    skipped = (provenance or {}).get("summary", {}).get("modules_skipped") or {}
    params = inspect_checkpoint(directory)["params"]
    kept = _kept_modules(checkpoint, fmt, set(quantized), skipped)
    if provenance is not None:
        version = provenance.get("qstream_version", "(version not recorded)")
        command, origin = provenance["command"], f"Recorded in `{PROVENANCE}` by qstream {version}."
    else:
        command, origin = _reconstruct_command(directory, fmt, quantized, base)
    return CheckpointFacts(directory, fmt, checkpoint.size_bytes, params, params_quantized,
                           quantized, kept, command, origin, integrity)  # fmt: skip


def _kept_modules(
    checkpoint: Checkpoint, fmt: str, quantized: set[str], skipped: dict[str, str]
) -> dict[str, tuple[tuple[int, ...], int, str]]:
    """Every weight-holding module that is not quantized, with its shape, size and reason: vLLM's,
    quantize's own, else the rule it falls under (docs/quantize.md, docs/formats.md)."""
    modules = weight_modules(checkpoint.tensors)
    profile = profile_for(checkpoint.config)
    # the group's label with layer indices as "*", so that a kind's rows share one reason
    fused = {m: module_kind(g.label) for g in fused_groups(modules, profile) for m in g.members}
    block = get_format(fmt).block_size
    kept = {}
    for module, info in modules.items():
        if module in quantized:
            continue
        shape = tuple(info.shape)
        if never := never_quantized(profile, module):
            why = f"vLLM never quantizes it: {never}"
        elif module in skipped:
            why = f"skipped at quantize time: {skipped[module]}"
        elif len(shape) != 2:
            why = f"{len(shape)}-D weight (norm scale or bias), not a Linear layer"
        elif is_embedding(module):
            why = "embedding table, not a Linear layer"
        elif module.rsplit(".", 1)[-1] in HEAD_NAMES:
            why = "output head"
        elif block and shape[1] % block:
            why = f"shape rule: K={shape[1]} is not a multiple of the {fmt} block size {block}"
        elif module in fused:
            why = f"not selected; fused group {fused[module]} stays whole (vLLM needs all or none)"
        else:
            why = "not selected (in the config's ignore list)"
        kept[module] = (shape, info.numel, why)
    return kept


def _reconstruct_command(
    directory: Path, fmt: str, quantized: list[str], base: CheckpointFacts | None
) -> tuple[str, str]:
    """An equivalent ``qstream-quantize`` command, checked to select the same set from the base."""
    # layers.3.mlp.gate_proj -> mlp.gate_proj (the part after the last index)
    split = [module.split(".") for module in quantized]
    last = [max((i for i, p in enumerate(parts) if p.isdigit()), default=-1) for parts in split]
    patterns = list(dict.fromkeys(".".join(p[i + 1 :]) for p, i in zip(split, last)))
    origin = f"Reconstructed from `config.json` (no `{PROVENANCE}` in the checkpoint)"
    base_dir = str(base.path) if base is not None else "BASE_DIR"
    args = ["qstream-quantize", "--model_dir", base_dir, "--output_dir", str(directory),
            "--quant_format", fmt, "--include_layers", *patterns]  # fmt: skip
    if base is None:
        return shlex.join(args), f"{origin} and not checked: no `--base` was given."
    base_checkpoint = open_checkpoint(base.path)
    profile = profile_for(base_checkpoint.config)
    for skip in (False, True):
        try:
            selection = select_modules(base_checkpoint.tensors, fmt, include=patterns,
                                       skip_incompatible=skip, profile=profile)  # fmt: skip
        except QStreamError:
            continue
        if sorted(selection.quantized) == sorted(quantized):
            return (
                shlex.join(args + (["--skip-incompatible"] if skip else [])),
                f"{origin}: an equivalent command, checked to select exactly the quantized "
                "modules from the base; not necessarily the command that was typed.",
            )
    args = args[: args.index("--include_layers") + 1] + quantized
    return shlex.join(args), f"{origin} as the explicit list of quantized modules."


def size_table(base: CheckpointFacts | None, checkpoints: list[CheckpointFacts]) -> Table:
    rows = [
        [Cell(f.path.name), Cell(f.fmt or "base (unquantized)"), Cell(f"{n:,}", n),
         Cell(f"{n / GIB:.3f}", n / GIB),
         Cell(f"{pct:.1f}%", pct) if base else Cell("n/a (no --base)")]
        for f in ([base] if base else []) + checkpoints
        for n in [f.size_bytes]
        for pct in [100.0 * n / base.size_bytes if base else None]
    ]  # fmt: skip
    return Table(
        "Size on disk: the safetensors files of each checkpoint directory",
        ["checkpoint", "format", "bytes", "GiB", "% of base"],
        rows,
        key="size",
        align="llrrr",
    )


def quantization_parts(facts: CheckpointFacts) -> list[Part]:
    """What is quantized to what in one checkpoint, why the rest is kept, and the command."""
    kinds = Counter(module_kind(m) for m in facts.quantized)
    q, total = facts.params_quantized, facts.params_total
    rows = [
        [Cell("parameters quantized / total in its files (tensors borrowed from the target not "
              "counted)"),
         Cell(f"{q:,} / {total:,} ({100.0 * q / total:.1f}%)", {"quantized": q, "total": total})],
        [Cell("modules quantized"), Cell(str(len(facts.quantized)), len(facts.quantized))],
        [Cell(f"module kinds quantized to {facts.fmt}"),
         Cell(", ".join(f"{k} ×{n}" for k, n in kinds.items()))],
        [Cell("modules kept unquantized"), Cell(str(len(facts.kept)), len(facts.kept))],
    ]  # fmt: skip
    summary = Table(f"{facts.path.name}: {facts.fmt} weights", ["", "value"], rows,
                    key=f"quantized_{facts.path.name}", align="ll")  # fmt: skip
    grouped: dict[tuple[str, str], list] = {}  # the kept modules by kind and reason
    for module, (shape, params, why) in facts.kept.items():
        grouped.setdefault((module_kind(module), why), []).append((shape, params))
    rows = [
        [Cell(kind), Cell(str(len(g)), len(g)),
         Cell("×".join(map(str, g[0][0])) if len({s for s, _ in g}) == 1 else "various"),
         Cell(f"{n:,}", n), Cell(why)]
        for (kind, why), g in grouped.items()
        for n in [sum(p for _, p in g)]
    ]  # fmt: skip
    kept = Table(
        f"{facts.path.name}: modules kept unquantized, and why",
        ["module kind", "count", "weight shape", "parameters", "why"],
        rows,
        key=f"kept_{facts.path.name}",
        align="lrrrl",
    )
    return [
        summary,
        kept,
        f"The command that produced `{facts.path.name}`. {facts.command_origin}",
        Code(facts.command or ""),
        integrity_sentence(facts),
    ]


def integrity_sentence(facts: CheckpointFacts) -> str:
    """Whether the checkpoint described is the one quantize wrote (docs/guarantees.md)."""
    record = facts.integrity
    if record.get("sha256") == "checked":
        return f"The sha256s of its {record['files']} files match `{PROVENANCE}`."
    if record.get("why") == NO_CHECK_FLAG:
        return (
            f"**`{facts.path.name}`: sha256 not checked (`{NO_CHECK_FLAG}`)**: its files may "
            f"differ from those `{PROVENANCE}` records."
        )
    return f"`{facts.path.name}`: sha256 not checked: {record.get('why')}."
