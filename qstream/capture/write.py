"""Turning one batch's tapped states into per-stream files (docs/capture.md): each row cut to
its stream's length (the right padding's states discarded), in the layout asked for."""

from __future__ import annotations

from pathlib import Path

import torch

from qstream.capture.hooks import LayerTap
from qstream.capture.layout import stream_tensors, vllm_tensors, write_stream
from qstream.eval.states.manifest import stream_file


def write_batch(
    output: Path,
    export: str,
    streams: list[int],
    rows: list[list[int]],
    tap: LayerTap,
    metadata: list[dict[str, str]],
) -> None:
    """Write stream ``streams[k]`` (token ids ``rows[k]``) from row k of the tapped batch."""
    if export == "vllm":
        layers, pre_norm = tap.layer_stack(), tap.pre_norm()  # [S, T, L, H], [S, T, H]
    else:
        aux, final = tap.aux(), tap.final()  # [S, T, L·H], [S, T, H]
    for k, (index, row) in enumerate(zip(streams, rows)):
        T = len(row)
        ids = torch.tensor(row, dtype=torch.int64)
        if export == "vllm":
            tensors = vllm_tensors(ids, layers[k, :T], pre_norm[k, :T])
        else:
            tensors = stream_tensors(ids, aux[k, :T], final[k, :T])
        write_stream(output / stream_file(index, export), tensors, metadata[k])
