"""Weight statistics of a checkpoint: what makes a tensor easy or hard to quantize
(heavy tails, outliers, channel scale spread).  ``qstream inspect`` prints these.

>>> rows = checkpoint_stats("ckpt/")        # one dict per floating-point tensor
"""

from __future__ import annotations

from pathlib import Path

import torch

from qstream.checkpoint.files import open_checkpoint
from qstream.checkpoint.safetensors_io import ShardReader

# Statistics of a huge tensor use an evenly strided sample of at most this many rows, so a
# k3 checkpoint is summarised in seconds; channel spreads use every column of those rows.
MAX_ROWS = 4096


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
        "kurtosis": float(centred.pow(4).mean()) / var ** 2 if var > 0 else float("nan"),
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
    """``weight_stats`` of every floating-point tensor of a checkpoint, in checkpoint order,
    each row with ``name``, ``shape`` and ``sampled_rows`` (rows used; see MAX_ROWS)."""
    checkpoint = open_checkpoint(directory)
    readers = {name: ShardReader(h) for name, h in checkpoint.shards.items()}
    rows = []
    for name, shard in checkpoint.tensor_shard.items():
        info = checkpoint.info(name)
        if info.dtype not in ("BF16", "F16", "F32") or info.numel == 0:
            continue
        tensor = readers[shard].tensor(name)
        if tensor.dim() == 2 and tensor.shape[0] > MAX_ROWS:
            tensor = tensor[torch.linspace(0, tensor.shape[0] - 1, MAX_ROWS).long()]
        rows.append({"name": name, "shape": list(info.shape),
                     "sampled_rows": int(tensor.shape[0]) if tensor.dim() else 1,
                     **weight_stats(tensor)})
        readers[shard].release(name)
    return rows
