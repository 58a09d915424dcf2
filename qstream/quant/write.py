"""The files of a quantized checkpoint besides the streamed tensors' bytes: the output shards'
layout, config.json with its quantization_config, the copied tokenizer and other files, and the
index (docs/quantize.md, "What is written")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from qstream.checkpoint.files import CONFIG_NAME, INDEX_NAME, Checkpoint
from qstream.checkpoint.layout import quantization_config, stored_tensors
from qstream.checkpoint.safetensors_io import PlannedTensor, ShardWriter
from qstream.errors import QStreamError
from qstream.quant.convert import Progress, write_tensors
from qstream.quant.select import Selection


def plan_shards(
    checkpoint: Checkpoint, selection: Selection, fmt: str
) -> dict[str, list[PlannedTensor]]:
    """Output tensors per shard: the input's, in order, each quantized weight replaced in place
    by what its format stores."""
    quantized = set(selection.quantized)
    plans = {}
    for shard, header in checkpoint.shards.items():
        planned = []
        for name, info in header.tensors.items():
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            if module in quantized:
                planned += stored_tensors(fmt, module, info)
            else:
                planned.append(PlannedTensor(name, info.dtype, info.shape))
        plans[shard] = planned
    return plans


def write_checkpoint(
    checkpoint,
    readers,
    selection,
    plans,
    fmt,
    amaxes,
    ignore,
    tmp: Path,
    device: torch.device,
    workers: int,
    snr: bool,
    progress: Progress | None,
) -> tuple[dict[str, float], dict[str, str]]:
    """config.json, the other files, every shard and the index, in ``tmp``; returns the
    weight SNR per quantized module and each shard's sha256, hashed as it was written."""
    _copy_other_files(checkpoint, tmp)
    config = dict(checkpoint.config)
    config["quantization_config"] = quantization_config(fmt, list(ignore))
    write_text(tmp / CONFIG_NAME, json_text(config))
    writers = {
        s: ShardWriter(tmp / s, plans[s], checkpoint.shards[s].metadata, digest=True) for s in plans
    }
    try:
        snr_db = write_tensors(
            checkpoint, readers, writers, selection, fmt, amaxes, device, workers, snr, progress
        )
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    digests = {}
    for shard, writer in writers.items():
        digest = writer.close()
        assert digest is not None  # made with digest=True
        digests[shard] = digest
    _write_index(checkpoint, writers, tmp)
    return snr_db, digests


def _copy_other_files(checkpoint: Checkpoint, tmp: Path) -> None:
    """Tokenizer, generation config, chat template, ...: everything but the weights, the index
    and config.json (rewritten); hidden top-level entries (.git, .cache) are not copied."""
    skip = checkpoint.weight_files | {CONFIG_NAME}
    for entry in sorted(checkpoint.directory.iterdir()):
        if entry.name in skip or entry.name.startswith("."):
            continue
        try:
            if entry.is_dir():
                shutil.copytree(entry, tmp / entry.name)
            else:
                shutil.copy2(entry, tmp / entry.name)
        except OSError as exc:
            raise QStreamError(f"cannot copy {entry}: {exc}") from exc


def _write_index(checkpoint: Checkpoint, writers: dict[str, ShardWriter], tmp: Path) -> None:
    if not checkpoint.has_index and len(writers) == 1:
        return
    weight_map = {name: shard for shard, w in writers.items() for name in w.infos}
    total = sum(i.nbytes for w in writers.values() for i in w.infos.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_text(tmp / INDEX_NAME, json_text(index))


def json_text(data) -> str:
    return json.dumps(data, indent=2) + "\n"


def write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
