"""Captured target states (``qstream eval-drift --states PATH``): token streams with the target's
aux hidden states and its final hidden state, read from a file or a directory in qstream's own
layout, vLLM's / speculators' or SpecForge's (docs/states.md).  The layout is told from the
files' contents (``format`` overrides); every file is checked before anything runs."""

from __future__ import annotations

import re
from pathlib import Path

from qstream.arch.interface import DraftConfig
from qstream.checkpoint.files import read_json
from qstream.errors import QStreamError
from qstream.eval.states.captured import (
    CONVENTIONS,
    CapturedStates,
    FinalNorm,
    check_layer_ids,
    file_sha256s,
    files_sha256,
    parse_convention,
    parse_ids,
    read_final_norm,
    target_depth,
)
from qstream.eval.states.layouts import LAYOUTS, RECORD, Layout, check_manifest, sniff

__all__ = ["AUTO", "CONVENTIONS", "LAYOUTS", "CapturedStates", "read_states"]

AUTO = "auto"
SUFFIXES = (".safetensors", ".ckpt", ".ckpt.gz")


def list_files(root: Path) -> list[Path]:
    """The states files: ``root`` itself, or every SUFFIXES file under it but hidden ones."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise QStreamError(f"--states {root}: no such file or directory")
    files = [
        p
        for p in root.rglob("*")
        if p.is_file()
        and p.name.endswith(SUFFIXES)
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    ]
    if not files:
        raise QStreamError(
            f"--states {root}: directory holds no {', '.join(SUFFIXES)} files (docs/states.md)"
        )
    # natural order: digit runs compare as numbers (hs_2 before hs_10)
    parts = {p: re.split(r"(\d+)", p.relative_to(root).as_posix()) for p in files}
    return sorted(files, key=lambda p: [int(t) if t.isdigit() else t for t in parts[p]])


def _resolve_format(files: list[Path], format: str | None) -> Layout:
    if format not in (None, AUTO):
        if format not in LAYOUTS:
            raise QStreamError(
                f"--states-format {format!r}: choose from auto, {', '.join(LAYOUTS)}"
            )
        return LAYOUTS[format]
    found: dict[Layout, Path] = {}
    for path in files:
        found.setdefault(sniff(path), path)
    if len(found) > 1:
        (a, pa), (b, pb) = list(found.items())[:2]
        raise QStreamError(
            f"--states: mixed layouts in one directory: {pa} is {a.name}, {pb} is {b.name}; keep "
            "one layout per directory"
        )
    return next(iter(found))


def _layers(
    root: Path,
    layout: Layout,
    config: DraftConfig,
    convention: str | None,
    layer_ids: object,
    target: str | None,
) -> tuple[dict, dict | None]:
    """The results' ``layers`` block (the layer ids capture.json and ``--states-layer-ids`` name,
    each checked against the draft) and the manifest (capture.json) if the directory has one."""
    manifest_path = root / RECORD
    manifest = read_json(manifest_path, RECORD) if manifest_path.is_file() else None
    if manifest is not None and not isinstance(manifest, dict):
        raise QStreamError(f"{manifest_path}: not a JSON object")
    used = None
    if convention is not None:
        used = parse_convention(convention, "--states-layer-convention")
    n, named = target_depth(config, target), []
    if manifest is not None:
        where = str(manifest_path)
        own = parse_convention(manifest.get("layer_convention"), f"{where}: layer_convention")
        if used is not None and used != own:
            raise QStreamError(
                f"{where}: layer_convention is {own.name}, but --states-layer-convention "
                f"says {used.name}"
            )
        ids = parse_ids(manifest.get("layer_ids"), f"{where}: layer_ids")
        check_layer_ids(ids, own, config, f"{where}: layer_ids", n)
        used = own
        named.append({"by": RECORD, "ids": list(ids)})
    used = used or layout.convention
    if layer_ids is not None:
        ids = parse_ids(layer_ids, "--states-layer-ids")
        check_layer_ids(ids, used, config, "--states-layer-ids", n)
        named.append({"by": "--states-layer-ids", "ids": list(ids)})
    draft = tuple(config.target_layer_ids)
    block = {
        "convention": used.name,
        "ids": list(used.from_layer_output(draft)),
        "named_by": named,  # [] when no file or option names its layers: only shapes are checked
        "draft_target_layer_ids": list(draft),
    }
    return block, manifest


def read_states(
    path: str | Path,
    config: DraftConfig,
    *,
    format: str | None = None,
    layer_convention: str | None = None,
    layer_ids: object = None,
    target: str | None = None,
) -> CapturedStates:
    """Open and validate captured states (a file or a directory) against the draft's config;
    ``target``: the target checkpoint, whose final norm normalizes a pre-norm final state."""
    root = Path(path)
    files = list_files(root)
    layout = _resolve_format(files, format)
    layers, manifest = _layers(root, layout, config, layer_convention, layer_ids, target)
    digests = file_sha256s(files, root)  # read once: checked and hashed into the identity
    checked = None if manifest is None else check_manifest(root, manifest, digests)
    pairs = [pair for f in files for pair in layout.open(f, config)]
    norm = FinalNorm()  # the target's, read once every file has been checked, where the
    if layout.final_before_norm:  # layout's final state is taken before it (vLLM)
        why = f"--states {root} ({layout.title} layout)"
        norm = read_final_norm(target, config.target_hidden_size, why)
    details = {
        "format": layout.name,
        "files": len(files),
        "layers": layers,
        "final_state": {"tensor": layout.final_tensor, "normalized_with": norm.to_json()},
        "manifest": manifest,
        **({} if checked is None else {"manifest_check": checked}),
    }
    return CapturedStates(
        name=str(root),
        sha256=files_sha256(digests, root),
        streams=tuple(ids for _, ids in pairs),
        tokenizer="(token ids from the states file)",
        sources=tuple(source for source, _ in pairs),
        details=details,
        aux_size=config.aux_size,
        norm=norm,
    )
