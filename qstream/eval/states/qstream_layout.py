"""qstream's own states layout (docs/states.md): one safetensors file holding either one stream as
``input_ids`` [T] (int32/int64), ``aux_hidden_states`` [T, num_target_layers·target_hidden_size]
and ``target_hidden_states`` [T, hidden_size] (float, after the target's final norm), or several
as ``stream.{i}.input_ids`` / ``stream.{i}.aux_hidden_states`` / ``stream.{i}.target_hidden_states``
for i = 0..S−1.  Position t's states are the target's after reading tokens 0..t.  A directory
holds several such files (``qstream capture --output DIR``).

Only the header and the token ids are read up front; hidden states are read (memory-mapped) a
batch of streams at a time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from qstream.arch.interface import DraftConfig
from qstream.errors import QStreamError
from qstream.eval.states.captured import (
    AUX,
    aux_why,
    check_float,
    check_ids,
    check_shape,
)

FIELDS = ("input_ids", "aux_hidden_states", "target_hidden_states")
STREAM_NAME = re.compile(r"stream\.(\d+)\.(\w+)$")
TENSOR_OF = {AUX: "aux_hidden_states", "target": "target_hidden_states"}


@dataclass(frozen=True)
class QStreamSource:
    """One stream of a qstream-layout file: its tensors carry ``prefix`` ("" or "stream.{i}.")."""

    where: str
    prefix: str

    def tensor_name(self, kind: str) -> str:
        return self.prefix + TENSOR_OF[kind]

    def rows(self, kind: str, start: int, stop: int) -> torch.Tensor:
        with safe_open(self.where, framework="pt") as f:
            return f.get_slice(self.tensor_name(kind))[start:stop].float()


def _stream_prefixes(path: Path, names: list[str]) -> tuple[str, ...]:
    """The streams of the file from its tensor names (module docstring), refusing any other."""
    if "input_ids" in names:
        for name in names:
            if name not in FIELDS:
                raise QStreamError(
                    f"{path}: unexpected tensor {name!r} beside a single stream's "
                    f"{', '.join(FIELDS)}"
                )
        return ("",)
    found: dict[int, set[str]] = {}
    for name in names:
        m = STREAM_NAME.match(name)
        if m is None or m.group(2) not in FIELDS:
            raise QStreamError(
                f"{path}: unexpected tensor {name!r}; expected input_ids, "
                "aux_hidden_states, target_hidden_states, or stream.{i}.<same>"
            )
        found.setdefault(int(m.group(1)), set()).add(m.group(2))
    if not found:
        raise QStreamError(f"{path}: holds no stream (no input_ids or stream.0.input_ids)")
    for i in range(max(found) + 1):
        missing = [f for f in FIELDS if f not in found.get(i, set())]
        if missing:
            raise QStreamError(
                f"{path}: missing tensor 'stream.{i}.{missing[0]}' (streams are "
                f"numbered 0..{max(found)} without gaps)"
            )
    return tuple(f"stream.{i}." for i in range(max(found) + 1))


def _check_stream(path: Path, f, prefix: str, config: DraftConfig) -> torch.Tensor:
    """Validate one stream's three tensors (dtype, rank, shape, id range); returns its ids."""
    ids_name = prefix + "input_ids"
    ids = check_ids(str(path), ids_name, f.get_tensor(ids_name), config)
    T = ids.numel()
    widths = {
        "aux_hidden_states": (config.aux_size, aux_why(config)),
        "target_hidden_states": (config.hidden_size, "the lm_head's width, hidden_size"),
    }
    for field, (width, why) in widths.items():
        name = prefix + field
        sl = f.get_slice(name)
        check_shape(str(path), name, sl.get_shape(), [T, width], f"T = len({ids_name}); {why}")
        check_float(str(path), name, sl.get_dtype())
    return ids


def open_qstream_file(path: Path, config: DraftConfig) -> list[tuple[QStreamSource, torch.Tensor]]:
    """Validate one qstream-layout file; its streams as (source, token ids)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            prefixes = _stream_prefixes(path, sorted(f.keys()))
            ids = [_check_stream(path, f, prefix, config) for prefix in prefixes]
    except QStreamError:
        raise
    except Exception as exc:  # safetensors reports a bad header with its own exception types
        raise QStreamError(f"{path}: not a readable safetensors file ({exc})") from None
    return [(QStreamSource(str(path), p), i) for p, i in zip(prefixes, ids)]
