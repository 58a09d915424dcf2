"""The output directory of a quantize run (docs/quantize.md, "What is written"): config.json with
its quantization_config, the copied tokenizer and other files, the streamed shards
(:mod:`qstream.quant.convert`), the index and the run's record, all written into a temporary
directory that is renamed into place (docs/guarantees.md)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from qstream.checkpoint.files import CONFIG_NAME, INDEX_NAME, Checkpoint, file_digests
from qstream.checkpoint.layout import quantization_config
from qstream.checkpoint.safetensors_io import ShardReader, ShardWriter
from qstream.errors import QStreamError
from qstream.publish import QUANTIZE_RECORD, publishing, write_json_atomic
from qstream.quant.convert import global_amaxes, write_tensors
from qstream.quant.plan import Plan, Streaming


def write_checkpoint(
    plan: Plan,
    output_path: Path,
    *,
    overwrite: bool,
    run: Streaming,
    record: Callable[[dict[str, float]], dict],
) -> dict[str, float]:
    """The global-amax pre-pass (before anything is written), then every file of the output;
    returns the weight SNR per quantized module.  ``record(snr_db)`` gives the head of the
    run's record (QUANTIZE_RECORD), to which the sha256 of every file is added."""
    readers = {name: ShardReader(h) for name, h in plan.checkpoint.shards.items()}
    amaxes = global_amaxes(plan, readers, run.workers)
    with publishing(output_path, overwrite) as tmp:
        _copy_other_files(plan.checkpoint, tmp)
        config = dict(plan.checkpoint.config)
        config["quantization_config"] = quantization_config(
            plan.format, list(plan.ignore), list(plan.targets)
        )
        write_json_atomic(tmp / CONFIG_NAME, config)
        snr_db, digests = _write_shards(plan, readers, amaxes, tmp, run)
        files = file_digests(tmp, known=digests)
        write_json_atomic(tmp / QUANTIZE_RECORD, {**record(snr_db), "files": files})
    return snr_db


def _write_shards(
    plan: Plan, readers, amaxes, tmp: Path, run: Streaming
) -> tuple[dict[str, float], dict[str, str]]:
    """Every shard and the index; returns the weight SNR per module and each shard's sha256,
    hashed as it was written."""
    writers = {
        s: ShardWriter(tmp / s, tensors, plan.checkpoint.shards[s].metadata, digest=True)
        for s, tensors in plan.shards.items()
    }
    try:
        snr_db = write_tensors(plan, readers, writers, amaxes, run)
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    digests = {}
    for shard, writer in writers.items():
        digest = writer.close()
        assert digest is not None  # made with digest=True
        digests[shard] = digest
    _write_index(plan.checkpoint, writers, tmp)
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
    write_json_atomic(tmp / INDEX_NAME, index)
