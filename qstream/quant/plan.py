"""What a quantize run will write, decided before any byte is: the :class:`Plan` that
:mod:`~qstream.quant.quantize` builds and hands down to :mod:`~qstream.quant.write` (the output's
files) and :mod:`~qstream.quant.convert` (the streamed tensors), and the :class:`Streaming`
settings of the run (docs/quantize.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qstream.checkpoint.files import Checkpoint
from qstream.checkpoint.layout import stored_tensors
from qstream.checkpoint.safetensors_io import PlannedTensor, planned_file_size
from qstream.formats import Format
from qstream.progress import Progress
from qstream.quant.select import Selection


@dataclass(frozen=True)
class Plan:
    checkpoint: Checkpoint
    selection: Selection
    format: Format
    ignore: list[str]  # the config's ignore entries, as written
    # output tensors per shard: the input's, in order, each quantized weight replaced in place
    # by what its format stores
    shards: dict[str, list[PlannedTensor]]
    # the config group's targets: "Linear", and any quantized ParallelLMHead by name
    targets: tuple[str, ...] = ("Linear",)

    @property
    def size_bytes(self) -> int:
        """The output's safetensors files, exactly."""
        meta = {s: h.metadata for s, h in self.checkpoint.shards.items()}
        return sum(planned_file_size(t, meta[s]) for s, t in self.shards.items())


def make_plan(
    checkpoint: Checkpoint,
    selection: Selection,
    spec: Format,
    ignore: list[str],
    targets: tuple[str, ...] = ("Linear",),
) -> Plan:
    quantized = set(selection.quantized)
    shards = {}
    for shard, header in checkpoint.shards.items():
        planned = []
        for name, info in header.tensors.items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module in quantized:
                planned += stored_tensors(spec, module, info)
            else:
                planned.append(PlannedTensor(name, info.dtype, info.shape))
        shards[shard] = planned
    return Plan(checkpoint, selection, spec, ignore, shards, targets)


@dataclass(frozen=True)
class Streaming:
    """How the tensors are streamed: where quantized, by how many threads, whether the weight
    SNR is accumulated, and who hears of progress."""

    device: torch.device
    workers: int
    snr: bool = True
    progress: Progress | None = None
