"""What ``qstream inspect`` prints of a checkpoint: its tensors by module kind
(:func:`inspect_checkpoint`) and its weights' statistics (:func:`checkpoint_stats`)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from qstream.checkpoint.files import open_checkpoint
from qstream.checkpoint.layout import config_format
from qstream.errors import QStreamError
from qstream.formats import get_format
from qstream.units import FLOAT_DTYPE_NAMES

_INDEX = re.compile(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)")


def module_kind(tensor: str) -> str:
    """``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.*.mlp.up_proj.weight``."""
    return _INDEX.sub("*", tensor)


def inspect_checkpoint(directory: str | Path) -> dict:
    """Rows per module kind and totals (``params`` counts logical weights: a packed byte is
    two parameters, scales are not parameters)."""
    checkpoint = open_checkpoint(directory)
    kinds: dict[str, dict] = {}
    for name, info in checkpoint.tensors.items():
        kind = module_kind(name)
        fresh = dict(
            kind=kind, tensors=0, elements=0, params=0, dtypes=[], shape=list(info.shape), bytes=0
        )
        row = kinds.setdefault(kind, fresh)
        suffix = name.rsplit(".", 1)[-1]
        row["tensors"] += 1
        row["elements"] += info.numel
        if suffix == "weight_packed":  # two 4-bit weights a byte
            row["params"] += 2 * info.numel
        elif not (suffix.startswith("weight_") or suffix in ("input_scale", "output_scale")):
            row["params"] += info.numel
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
        "quant_format": config_format(checkpoint.config),
    }


# Statistics of a huge tensor use an evenly strided sample of at most this many rows, so a
# k3 checkpoint is summarised in seconds; channel spreads use every column of those rows.
MAX_ROWS = 4096
NON_FINITE_SLICE = 1 << 20  # elements checked for NaN/Inf at a time


def weight_stats(w: torch.Tensor) -> dict[str, float]:
    """``std``; excess-free ``kurtosis`` (3 for a Gaussian); ``max_over_std`` = max|w| / std;
    for 2-D ``[out, in]`` weights also ``row_spread`` / ``col_spread`` = p99 / p50 of the
    per-output-row / per-input-column RMS (1.0 when every channel has the same scale)."""
    x = w.detach().double()
    flat = x.reshape(-1)
    std = float(flat.std()) if flat.numel() > 1 else 0.0
    centred = flat - flat.mean()
    var = float(centred.pow(2).mean())
    stats = {
        "std": std,
        "kurtosis": float(centred.pow(4).mean()) / var**2 if var > 0 else float("nan"),
        "max_over_std": float(flat.abs().max()) / std if std > 0 else float("nan"),
    }
    if x.dim() == 2 and min(x.shape) > 1:
        stats["row_spread"] = _spread(x.pow(2).mean(1).sqrt())
        stats["col_spread"] = _spread(x.pow(2).mean(0).sqrt())
    return stats


def _spread(rms: torch.Tensor) -> float:
    p50, p99 = torch.quantile(rms, torch.tensor([0.5, 0.99], dtype=rms.dtype)).tolist()
    return p99 / p50 if p50 > 0 else float("inf")


def checkpoint_stats(directory: str | Path) -> list[dict]:
    """``weight_stats`` of every weight of a checkpoint, in checkpoint order, each row with
    ``name``, ``shape``, ``sampled_rows`` (rows used; see MAX_ROWS) and ``non_finite`` (NaN
    and Inf elements, counted over the whole tensor; statistics are null when it is not 0).  A
    quantized module is one row for its dequantized ``.weight`` (``"dequantized": true``), never
    rows for its scale tensors: the statistics describe the weights, whatever their storage."""
    checkpoint = open_checkpoint(directory)
    fmt = config_format(checkpoint.config)
    spec = None if fmt is None else get_format(fmt)
    stored = set(spec.stored) - {"weight"} if spec else set()
    quantized = {
        n.rpartition(".")[0] for n in checkpoint.tensor_shard if n.rpartition(".")[2] in stored
    }
    rows = []
    for name in checkpoint.tensor_shard:
        module, _, suffix = name.rpartition(".")
        if module in quantized:
            assert spec is not None  # modules are quantized only under a known format
            if suffix == spec.stored[0]:  # one row per module
                parts = {s: _read(checkpoint, f"{module}.{s}") for s in spec.stored}
                rows.append(
                    _row(f"{module}.weight", spec.dequantize(parts).float(), dequantized=True)
                )
            continue
        info = checkpoint.info(name)
        if info.dtype not in FLOAT_DTYPE_NAMES or info.numel == 0:
            continue
        rows.append(_row(name, checkpoint.tensor(name)))
        checkpoint.release(name)
    return rows


def _read(checkpoint, name: str) -> torch.Tensor:
    if name not in checkpoint.tensor_shard:
        raise QStreamError(
            f"{checkpoint.directory}: quantized module lacks {name!r} "
            "(qstream verify lists every problem)"
        )
    return checkpoint.tensor(name)


def _row(name: str, tensor: torch.Tensor, dequantized: bool = False) -> dict:
    """One tensor's row.  A tensor holding NaN or Inf gets their count (over every element, in
    slices, so that the mask stays small) and no statistics: they would be NaN, or describe a
    tensor quantize refuses as if it were fine."""
    shape = list(tensor.shape)
    flat = tensor.reshape(-1)
    non_finite = sum(
        int((~torch.isfinite(flat[i : i + NON_FINITE_SLICE])).sum())
        for i in range(0, flat.numel(), NON_FINITE_SLICE)
    )
    if tensor.dim() == 2 and tensor.shape[0] > MAX_ROWS:
        tensor = tensor[torch.linspace(0, tensor.shape[0] - 1, MAX_ROWS).long()]
    stats = weight_stats(tensor)
    return {
        "name": name,
        "shape": shape,
        "sampled_rows": int(tensor.shape[0]) if tensor.dim() else 1,
        **({"dequantized": True} if dequantized else {}),
        "non_finite": non_finite,
        **(dict.fromkeys(stats) if non_finite else stats),
    }
