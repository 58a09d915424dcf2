"""Weight statistics of a checkpoint: what makes a tensor easy or hard to quantize
(heavy tails, outliers, channel scale spread).  ``qstream inspect`` prints these.

>>> rows = checkpoint_stats("ckpt/")        # one dict per floating-point tensor
"""

from __future__ import annotations

from pathlib import Path

import torch

from qstream.checkpoint.files import open_checkpoint
from qstream.checkpoint.layout import format_of_layout
from qstream.checkpoint.safetensors_io import ShardReader
from qstream.errors import QStreamError
from qstream.formats import Format, get_format
from qstream.units import FLOAT_DTYPE_NAMES

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
    readers = {name: ShardReader(h) for name, h in checkpoint.shards.items()}
    spec = _format(checkpoint.config)
    stored = set(spec.stored) - {"weight"} if spec else set()
    quantized = {
        n.rpartition(".")[0] for n in checkpoint.tensor_shard if n.rpartition(".")[2] in stored
    }
    rows = []
    for name, shard in checkpoint.tensor_shard.items():
        module, _, suffix = name.rpartition(".")
        if module in quantized:
            assert spec is not None  # modules are quantized only under a known format
            if suffix == spec.stored[0]:  # one row per module
                parts = {s: _read(checkpoint, readers, f"{module}.{s}") for s in spec.stored}
                rows.append(
                    _row(f"{module}.weight", spec.dequantize(parts).float(), dequantized=True)
                )
            continue
        info = checkpoint.info(name)
        if info.dtype not in FLOAT_DTYPE_NAMES or info.numel == 0:
            continue
        rows.append(_row(name, readers[shard].tensor(name)))
        readers[shard].release(name)
    return rows


def _format(config: dict) -> Format | None:
    qc = config.get("quantization_config")
    layout = qc.get("format") if isinstance(qc, dict) else None
    fmt = format_of_layout(layout) if isinstance(layout, str) else None
    return None if fmt is None else get_format(fmt)


def _read(checkpoint, readers, name: str) -> torch.Tensor:
    if name not in checkpoint.tensor_shard:
        raise QStreamError(
            f"{checkpoint.directory}: quantized module lacks {name!r} "
            "(qstream verify lists every problem)"
        )
    return readers[checkpoint.tensor_shard[name]].tensor(name)


def non_finite_count(w: torch.Tensor) -> int:
    """NaN and Inf elements of ``w``, counted over every element (a row sample could miss
    them) in slices of ``NON_FINITE_SLICE``, so that the mask stays small."""
    flat = w.reshape(-1)
    return sum(
        int((~torch.isfinite(flat[i : i + NON_FINITE_SLICE])).sum())
        for i in range(0, flat.numel(), NON_FINITE_SLICE)
    )


def _row(name: str, tensor: torch.Tensor, dequantized: bool = False) -> dict:
    """One tensor's row.  A tensor holding NaN or Inf gets its count (``non_finite``) and no
    statistics: they would be NaN, or describe a tensor quantize refuses as if it were fine."""
    shape = list(tensor.shape)
    non_finite = non_finite_count(tensor)
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
