"""Reading a checkpoint's tensors as weights: quantized modules dequantized by the format its
``quantization_config`` names, and a target's borrowed tensors (``lm_head.weight``,
``embed_tokens.weight``, ``model.norm.weight``) read from only the shards holding them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from qstream.checkpoint.files import (
    INDEX_NAME,
    Checkpoint,
    open_checkpoint,
    read_config,
    read_json,
)
from qstream.checkpoint.layout import KV_SCALES, config_format
from qstream.checkpoint.safetensors_io import ShardReader, read_header
from qstream.errors import QStreamError
from qstream.formats import FORMATS, QUANTIZED_SUFFIXES, dequantize
from qstream.units import FLOAT_DTYPES


def checkpoint_format(directory: Path, config: dict) -> str | None:
    """The format ``config``'s quantization_config names (None: not quantized)."""
    qc = config.get("quantization_config")
    fmt = config_format(config)
    if fmt is None and qc is not None:
        layout = qc.get("format") if isinstance(qc, dict) else None
        raise QStreamError(
            f"{directory / 'config.json'}: quantization_config.format = {layout!r} is not one "
            f"of {', '.join(s.layout for s in FORMATS.values())}"
        )
    return fmt


def dequantize_all(
    raw: Mapping[str, torch.Tensor], fmt: str | None, where: str
) -> dict[str, torch.Tensor]:
    """Replace each quantized module's stored tensors by its dequantized ``.weight``."""
    stored_suffixes = set(FORMATS[fmt].stored) if fmt else set()
    modules: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        module, _, suffix = name.rpartition(".")
        # a stored "weight" is quantized codes only beside a weight_scale (FP8)
        if suffix in stored_suffixes and (suffix != "weight" or f"{module}.weight_scale" in raw):
            modules.setdefault(module, {})[suffix] = tensor
        elif suffix in QUANTIZED_SUFFIXES:
            raise QStreamError(
                f"{where}: tensor {name!r} is quantization data, but the config declares "
                f"{'no' if fmt is None else fmt} quantization for it"
            )
        else:
            out[name] = tensor
    for module, stored in modules.items():
        assert fmt is not None  # modules are collected only under a quantization config
        missing = [s for s in FORMATS[fmt].stored if s not in stored]
        if missing:
            raise QStreamError(
                f"{where}: quantized module {module!r} lacks {module}.{missing[0]} ({fmt} stores "
                f"{', '.join(FORMATS[fmt].stored)})"
            )
        try:
            out[f"{module}.weight"] = dequantize(fmt, stored)
        except (RuntimeError, ValueError) as exc:
            raise QStreamError(f"{where}: cannot dequantize {module!r} as {fmt}: {exc}") from None
    return out


def read_draft_checkpoint(
    directory: str | Path, index_names: Iterable[str] = ()
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(floats, index)``: a draft checkpoint's tensors, quantized modules dequantized, and those
    of ``index_names`` as stored (d2t); any other non-float tensor is one line naming it."""
    directory = Path(directory)
    checkpoint = open_checkpoint(directory)
    scales = kv_scale_names(checkpoint)  # served with the cache (read_kv_scales), not weights
    raw = {n: checkpoint.tensor(n) for n in checkpoint.tensor_shard if n not in scales}
    names = set(index_names)
    index = {n: raw.pop(n) for n in list(raw) if n in names}
    tensors = dequantize_all(raw, checkpoint_format(directory, checkpoint.config), str(directory))
    for name, tensor in tensors.items():
        if tensor.dtype not in FLOAT_DTYPES:
            raise QStreamError(
                f"{directory}: tensor {name!r} is {tensor.dtype}, not a float "
                "weight (quantized data the config does not declare?)"
            )
    return tensors, index


def kv_scale_names(checkpoint: Checkpoint) -> set[str]:
    """The attention layers' ``k_scale`` / ``v_scale`` of a checkpoint declaring a
    ``kv_cache_scheme`` (none otherwise: such a tensor is then an unexpected one)."""
    if (checkpoint.config.get("quantization_config") or {}).get("kv_cache_scheme") is None:
        return set()
    return {n for n in checkpoint.tensor_shard if n.rpartition(".")[2] in KV_SCALES}


def read_kv_scales(directory: Path) -> dict[str, tuple[float, float]]:
    """Each attention layer's stored (k_scale, v_scale) as vLLM 0.32.0 holds them, float32
    (``KVCacheScaleParameter.weight_loader``, vllm/model_executor/layers/quantization/kv_cache.py);
    QStreamError for a layer without both, or a scale not one finite positive number."""
    checkpoint = open_checkpoint(directory)
    names, where = kv_scale_names(checkpoint), checkpoint.directory
    out: dict[str, tuple[float, float]] = {}
    for attention in sorted(checkpoint.attention_layers):
        values = []
        for name in (f"{attention}.{leaf}" for leaf in KV_SCALES):
            if name not in names:
                raise QStreamError(f"{where}: {name} missing (its kv_cache_scheme stores k_scale "
                                   "and v_scale per attention layer)")  # fmt: skip
            tensor = checkpoint.tensor(name)
            values.append(float(tensor.float().flatten()[0]) if tensor.numel() == 1 else math.nan)
            if not (math.isfinite(values[-1]) and values[-1] > 0):
                raise QStreamError(
                    f"{where}: {name} must be one finite scale > 0, not {values[-1]}"
                )
        out[attention] = (values[0], values[1])
    return out


def read_target_tensors(
    target: str | Path, names: Iterable[str], optional: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Read only ``names`` from a target checkpoint: the one tensor equal to each or ending in
    ``.<name>`` (``language_model.lm_head.weight``; a name in ``optional`` may have none), from
    only the shards holding them."""
    target = Path(target)
    index = target / INDEX_NAME
    if index.exists():
        data = read_json(index, "safetensors index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise QStreamError(f"{index}: no weight_map of tensor name -> shard file")
    else:
        shards = sorted(p.name for p in target.glob("*.safetensors"))
        if not shards:
            raise QStreamError(f"{target}: no {INDEX_NAME} and no *.safetensors files")
        weight_map = {t: s for s in shards for t in read_header(target / s).tensors}
    fmt = (
        checkpoint_format(target, read_config(target))
        if (target / "config.json").exists()
        else None
    )
    out, readers = {}, {}
    for name in names:
        if name in optional and not any(t == name or t.endswith("." + name) for t in weight_map):
            continue
        source = _match_one(weight_map, name, target)
        module = source[: -len(".weight")]
        wanted = {source} | {
            f"{module}.{s}" for s in QUANTIZED_SUFFIXES if f"{module}.{s}" in weight_map
        }
        raw = {}
        for t in wanted:
            shard = weight_map[t]
            if shard not in readers:
                if Path(shard).name != shard or not (target / shard).is_file():
                    raise QStreamError(
                        f"{target}: tensor {t!r} is mapped to missing shard {shard!r}"
                    )
                readers[shard] = ShardReader(read_header(target / shard))
            if t not in readers[shard].header.tensors:
                raise QStreamError(f"{target / shard}: does not contain {t!r} (index says so)")
            raw[t.replace(module, name[: -len(".weight")], 1)] = readers[shard].tensor(t)
        out.update(dequantize_all(raw, fmt if len(raw) > 1 else None, str(target)))
    return out


def _match_one(weight_map: Mapping[str, str], name: str, target: Path) -> str:
    hits = [name] if name in weight_map else [t for t in weight_map if t.endswith("." + name)]
    if len(hits) != 1:
        found = "none" if not hits else ", ".join(hits[:4])
        raise QStreamError(
            f"{target}: need exactly one tensor named {name!r} or ending in '.{name}'; "
            f"found {found}"
        )
    return hits[0]
