"""The layout SpecForge's ``scripts/prepare_hidden_states.py --strategy dspark`` writes
(docs/states.md): one ``torch.save`` file per sample, ``rows_{a}-{b}/data_{idx}.ckpt`` (or
``.ckpt.gz``, gzip-compressed), holding a dict of ``input_ids`` [T], ``loss_mask`` [T],
``hidden_states`` [1, T, num_target_layers·H] (the draft's target layers, layer-output
convention) and ``target_last_hidden_states`` [1, T, H] (after the target's final norm).

Files are loaded with ``torch.load(weights_only=True)``: tensors and plain containers only, so a
pickle that would call code is refused, never run.  An uncompressed file is memory-mapped; a
gzip one is decompressed whole, one file at a time (the last two are kept).
"""

from __future__ import annotations

import gzip
import io
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from qstream.arch.interface import DraftConfig
from qstream.errors import QStreamError
from qstream.eval.states.captured import AUX, aux_why, check_float, check_ids, check_shape

IDS, AUX_NAME, FINAL = "input_ids", "hidden_states", "target_last_hidden_states"
ALLOWED = (IDS, "loss_mask", AUX_NAME, FINAL)
ZIP_MAGIC, GZIP_MAGIC = b"PK\x03\x04", b"\x1f\x8b"


@lru_cache(maxsize=2)
def load_record(path: str) -> dict:
    """The dict a SpecForge file holds; QStreamError (one line) for anything else."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic[:2] == GZIP_MAGIC:
            with gzip.open(path, "rb") as gz:
                data = io.BytesIO(gz.read())
            record = torch.load(data, map_location="cpu", weights_only=True)
        else:
            mmap = magic == ZIP_MAGIC
            record = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # pickle, zip, gzip and torch each raise their own types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise QStreamError(
            f"{path}: not a torch.save file of plain tensors (torch.load with "
            f"weights_only=True refused it: {type(exc).__name__}: {first})"
        ) from None
    if not isinstance(record, dict):
        raise QStreamError(f"{path}: holds a {type(record).__name__}, expected a dict of tensors")
    return record


def _squeezed(path: Path, record: dict, name: str, T: int, width: int, why: str) -> None:
    """Check ``record[name]`` is [1, T, width] (as SpecForge saves it) or [T, width], float."""
    tensor = record.get(name)
    if not isinstance(tensor, torch.Tensor):
        what = "missing" if tensor is None else f"a {type(tensor).__name__}, not a tensor"
        extra = " (SpecForge writes it with --strategy dspark)" if name == FINAL else ""
        raise QStreamError(f"{path}: tensor {name!r} is {what}{extra}")
    shape = list(tensor.shape)
    check_shape(str(path), name, shape[1:] if len(shape) == 3 and shape[0] == 1 else shape,
                [T, width], f"T = len({IDS}); {why}")  # fmt: skip
    check_float(str(path), name, tensor.dtype)


@dataclass(frozen=True)
class SpecForgeSource:
    where: str

    def tensor_name(self, kind: str) -> str:
        return AUX_NAME if kind == AUX else FINAL

    def rows(self, kind: str, start: int, stop: int) -> torch.Tensor:
        tensor = load_record(self.where)[self.tensor_name(kind)]
        if tensor.ndim == 3:
            tensor = tensor[0]
        return tensor[start:stop].float()


def open_specforge_file(
    path: Path, config: DraftConfig
) -> list[tuple[SpecForgeSource, torch.Tensor]]:
    """Validate one sample's file; its one stream as (source, token ids)."""
    record = load_record(str(path))
    for name in record:
        if name not in ALLOWED:
            raise QStreamError(
                f"{path}: unexpected entry {name!r}; SpecForge's dspark strategy writes "
                f"{', '.join(ALLOWED)}"
            )
    ids = record.get(IDS)
    if not isinstance(ids, torch.Tensor):
        raise QStreamError(f"{path}: tensor {IDS!r} is missing")
    ids = check_ids(str(path), IDS, ids, config)
    T = ids.numel()
    _squeezed(path, record, AUX_NAME, T, config.aux_size, aux_why(config))
    _squeezed(path, record, FINAL, T, config.hidden_size, "the lm_head's width, hidden_size")
    return [(SpecForgeSource(str(path)), ids)]
