"""Captured target states (``qstream eval-drift --states PATH``): token streams with the target's
aux hidden states and its final hidden state, read from a file or a directory in qstream's own
layout, vLLM's / speculators' or SpecForge's (docs/states.md).  The layout is told from the
files' contents (``format`` overrides); every file is checked before anything runs, and the
layer ids capture.json or the options name against the draft's."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from qstream.arch.interface import DraftConfig
from qstream.checkpoint.files import read_config, read_json, sha256_file
from qstream.checkpoint.read import read_target_tensors
from qstream.checkpoint.target import read_target_shape
from qstream.errors import QStreamError
from qstream.eval.states.captured import CONVENTIONS, CapturedStates, Convention, FinalNorm
from qstream.eval.states.layouts import LAYOUTS, RECORD, Layout, check_manifest, sniff

__all__ = ["AUTO", "CONVENTIONS", "LAYOUTS", "CapturedStates", "read_states"]

AUTO = "auto"
SUFFIXES = (".safetensors", ".ckpt", ".ckpt.gz")
FINAL_NORM = "model.norm.weight"  # the final norm of a transformers decoder (not a layer's norm)


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


def parse_convention(value: object, where: str) -> Convention:
    name = value.replace("_", "-") if isinstance(value, str) else None
    if name not in CONVENTIONS:
        raise QStreamError(
            f"{where}: layer convention {value!r} is not one of {', '.join(CONVENTIONS)}"
        )
    return CONVENTIONS[name]


def parse_ids(value: object, where: str) -> tuple[int, ...]:
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if not all(p.isdigit() for p in parts):
            raise QStreamError(f"{where}: layer ids {value!r} are not comma-separated integers")
        value = [int(p) for p in parts]
    if not (
        isinstance(value, list | tuple)
        and value
        and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    ):
        raise QStreamError(f"{where}: layer ids {value!r} are not a list of integers")
    return tuple(value)


def target_depth(config: DraftConfig, target: str | None) -> int | None:
    """The target's layer count: the draft's ``target_num_hidden_layers``, else (a speculators
    draft has none) ``target``'s config.json."""
    if config.target_num_hidden_layers is not None or target is None:
        return config.target_num_hidden_layers
    return read_target_shape(target).num_hidden_layers


def check_layer_ids(
    ids: tuple[int, ...], convention: Convention, config: DraftConfig, where: str, n: int | None
):
    """Refuse ids that are not the draft's ``target_layer_ids``; a trailing last layer (output
    ``n`` − 1) names the final state and is allowed."""
    wanted = tuple(config.target_layer_ids)
    lo = convention.to_layer_output(ids)
    if len(lo) == len(wanted) + 1 and n is not None and lo[-1] == n - 1:
        lo = lo[:-1]  # speculators appends the last layer (its final state)
    if lo != wanted:
        raise QStreamError(
            f"{where}: layer ids {list(ids)} ({convention.name}) are layers {list(lo)} in the "
            f"layer-output convention; the draft's target_layer_ids are {list(wanted)} "
            + (
                f"(the target's {n} layers)"
                if n
                else "(the target's layer count unknown: pass "
                "--target, whose config.json has num_hidden_layers)"
            )
        )


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


def read_final_norm(target: str | None, width: int, why: str) -> FinalNorm:
    if target is None:
        raise QStreamError(
            f"{why}: its final state is taken before the target's final norm; pass --target "
            f"HF_DIR (the target checkpoint: its {FINAL_NORM} and config.json rms_norm_eps) "
            "to normalize it"
        )
    weight = read_target_tensors(target, [FINAL_NORM])[FINAL_NORM]
    if list(weight.shape) != [width]:
        raise QStreamError(
            f"{target}: {FINAL_NORM} has shape {list(weight.shape)}, expected [{width}] "
            "(the final state's width)"
        )
    config = read_config(Path(target))
    eps = config.get("rms_norm_eps", (config.get("text_config") or {}).get("rms_norm_eps"))
    if not isinstance(eps, int | float) or isinstance(eps, bool) or not eps > 0:
        raise QStreamError(
            f"{Path(target) / 'config.json'}: rms_norm_eps = {eps!r}, expected a positive "
            "number (the final norm's epsilon)"
        )
    return FinalNorm(weight.float(), float(eps), f"{target}:{FINAL_NORM}")


def files_sha256(digests: dict[str, str], root: Path) -> str:
    """sha256 of one file, or of a directory's files (relative name and each file's sha256)."""
    if root.is_file():
        return next(iter(digests.values()))
    digest = hashlib.sha256()
    for name, file_digest in digests.items():
        digest.update(f"{name}\0{file_digest}\n".encode())
    return digest.hexdigest()


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
    # read once: checked, and hashed into the identity (a file given alone: by its name)
    digests = {
        f.name if f == root else f.relative_to(root).as_posix(): sha256_file(f) for f in files
    }
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
