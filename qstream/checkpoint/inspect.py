"""``inspect_checkpoint``: a checkpoint's tensors grouped by module kind, with parameter counts,
dtypes and sizes, and its quantization config if it has one."""

from __future__ import annotations

import re
from pathlib import Path

from qstream.checkpoint.files import open_checkpoint
from qstream.checkpoint.layout import format_of_layout

_INDEX = re.compile(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)")

# Stored suffixes whose elements pack two 4-bit weights (the logical parameter count doubles).
_PACKED = "weight_packed"


def module_kind(tensor: str) -> str:
    """``model.layers.3.mlp.experts.7.up_proj.weight`` -> ``model.layers.*.mlp.experts.*.up_proj.weight``."""
    return _INDEX.sub("*", tensor)


def inspect_checkpoint(directory: str | Path) -> dict:
    """Rows per module kind and totals (``params`` counts logical weights: a packed byte is
    two parameters, scales are not parameters)."""
    checkpoint = open_checkpoint(directory)
    kinds: dict[str, dict] = {}
    for name, info in checkpoint.tensors.items():
        row = kinds.setdefault(
            module_kind(name),
            {
                "kind": module_kind(name),
                "tensors": 0,
                "elements": 0,
                "params": 0,
                "dtypes": [],
                "shape": list(info.shape),
                "bytes": 0,
            },
        )
        row["tensors"] += 1
        row["elements"] += info.numel
        row["params"] += _logical_params(name, info.numel)
        row["bytes"] += info.nbytes
        if info.dtype not in row["dtypes"]:
            row["dtypes"].append(info.dtype)
        if row["shape"] != list(info.shape):
            row["shape"] = None  # shapes differ across instances of the kind
    qconfig = checkpoint.config.get("quantization_config")
    return {
        "directory": str(checkpoint.directory),
        "shards": len(checkpoint.shards),
        "tensors": len(checkpoint.tensor_shard),
        "params": sum(r["params"] for r in kinds.values()),
        "bytes": checkpoint.size_bytes,
        "kinds": list(kinds.values()),
        "quantization_config": qconfig,
        "quant_format": format_of_layout(qconfig.get("format", ""))
        if isinstance(qconfig, dict)
        else None,
    }


def _logical_params(name: str, numel: int) -> int:
    suffix = name.rsplit(".", 1)[-1]
    if suffix == _PACKED:
        return 2 * numel
    if suffix.startswith("weight_") or suffix in ("input_scale", "output_scale"):
        return 0
    return numel
