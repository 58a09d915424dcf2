"""Captured target states (``qstream eval-drift --states FILE``): token streams with the target's
aux hidden states and its final hidden state, read from one safetensors file (docs/states.md).

Layout: either one stream as ``input_ids`` [T] (int32/int64), ``aux_hidden_states``
[T, num_target_layers·target_hidden_size] and ``target_hidden_states`` [T, hidden_size] (float),
or several as ``stream.{i}.input_ids`` / ``stream.{i}.aux_hidden_states`` /
``stream.{i}.target_hidden_states`` for i = 0..S−1.  Position t's states are the target's after
reading tokens 0..t, so ``target_hidden_states[t] @ lm_headᵀ`` are its logits for token t+1.

Only the header and the token ids are read up front; hidden states are read (memory-mapped) a
batch of streams at a time.

>>> states = read_states("captured.safetensors", config)
>>> plan = sample_anchors(states, 1024, config.block_size, seed=0)
>>> aux = states.aux([0, 3], pad_to=512)                   # [2, 512, A] float32
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from qstream.errors import QStreamError
from qstream.eval.corpus import AnchorPlan, Corpus
from qstream.model.config import DSparkConfig
from qstream.units import FLOAT_DTYPE_NAMES

FIELDS = ("input_ids", "aux_hidden_states", "target_hidden_states")
STREAM_NAME = re.compile(r"stream\.(\d+)\.(\w+)$")
ID_DTYPES = (torch.int32, torch.int64)
_HASH_CHUNK = 1 << 24


@dataclass(frozen=True)
class CapturedStates(Corpus):
    """A corpus whose aux states and target states come from a captured file."""

    path: str = ""
    prefixes: tuple[str, ...] = ()  # tensor-name prefix of each stream: "" or "stream.{i}."

    def _rows(self, stream: int, field: str, start: int, stop: int) -> torch.Tensor:
        with safe_open(self.path, framework="pt") as f:
            rows = f.get_slice(self.prefixes[stream] + field)[start:stop]
        if not bool(torch.isfinite(rows).all()):
            raise QStreamError(
                f"{self.path}: tensor {self.prefixes[stream] + field!r} holds "
                f"non-finite values in positions {start}..{stop - 1}"
            )
        return rows.float()

    def aux(self, streams: list[int], pad_to: int) -> torch.Tensor:
        """Aux states [S, pad_to, A] float32 of ``streams``, zero-padded (cut at ``pad_to``)."""
        rows = [
            self._rows(s, "aux_hidden_states", 0, min(pad_to, int(self.streams[s].numel())))
            for s in streams
        ]
        out = torch.zeros(len(streams), pad_to, rows[0].shape[-1])
        for i, r in enumerate(rows):
            out[i, : r.shape[0]] = r
        return out

    def target_hidden(
        self, stream: torch.Tensor, anchor: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """``[n, B, H]`` float32: the target's final hidden states at positions p..p+B−1 of each
        block (those predicting the block's tokens p+1..p+B)."""
        out = None
        for s in stream.unique().tolist():
            rows = (stream == s).nonzero().squeeze(1)
            lo, hi = int(anchor[rows].min()), int(anchor[rows].max()) + block_size
            states = self._rows(s, "target_hidden_states", lo, hi)
            if out is None:
                out = torch.empty(stream.numel(), block_size, states.shape[-1])
            positions = anchor[rows, None] - lo + torch.arange(block_size)  # [m, B]
            out[rows] = states[positions]
        assert out is not None, "no blocks"
        return out

    def block_tokens(self, plan: AnchorPlan, block_size: int) -> torch.Tensor:
        """``[N, B]`` the stream's own tokens p+1..p+B of every block of ``plan``."""
        return torch.stack(
            [
                self.streams[s][p + 1 : p + 1 + block_size]
                for s, p in zip(plan.stream.tolist(), plan.anchor.tolist())
            ]
        )


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


def _check_stream(path: Path, f, prefix: str, config: DSparkConfig) -> torch.Tensor:
    """Validate one stream's three tensors (dtype, rank, shape, id range); returns its ids."""
    ids_name = prefix + "input_ids"
    ids = f.get_tensor(ids_name)
    if ids.dtype not in ID_DTYPES or ids.ndim != 1:
        raise QStreamError(
            f"{path}: tensor {ids_name!r} must be 1-D int32/int64, got "
            f"{str(ids.dtype).removeprefix('torch.')} {list(ids.shape)}"
        )
    T = ids.numel()
    if T < config.block_size + 2:
        raise QStreamError(
            f"{path}: tensor {ids_name!r} has {T} tokens; a block needs at least "
            f"{config.block_size + 2} (one context token, the block, its last "
            "token's successor)"
        )
    if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
        raise QStreamError(
            f"{path}: tensor {ids_name!r} holds ids outside [0, "
            f"{config.vocab_size}) (the model's vocab_size)"
        )
    widths = {
        "aux_hidden_states": (
            config.aux_size,
            f"num_target_layers·target_hidden_size = "
            f"{config.num_target_layers}·{config.target_hidden_size}",
        ),
        "target_hidden_states": (config.hidden_size, "the lm_head's width, hidden_size"),
    }
    for field, (width, why) in widths.items():
        name = prefix + field
        sl = f.get_slice(name)
        shape, dtype = list(sl.get_shape()), sl.get_dtype()
        if shape != [T, width]:
            raise QStreamError(
                f"{path}: tensor {name!r} has shape {shape}, expected {[T, width]} "
                f"(T = len({ids_name}); {why})"
            )
        if dtype not in FLOAT_DTYPE_NAMES:
            raise QStreamError(
                f"{path}: tensor {name!r} has dtype {dtype}, expected one of "
                f"{', '.join(FLOAT_DTYPE_NAMES)}"
            )
    return ids.long()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_states(path: str | Path, config: DSparkConfig) -> CapturedStates:
    """Open and validate a captured-states file against the draft's config; QStreamError (one
    line, naming the tensor) for anything that does not fit."""
    path = Path(path)
    if not path.is_file():
        raise QStreamError(f"--states {path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            prefixes = _stream_prefixes(path, sorted(f.keys()))
            streams = tuple(_check_stream(path, f, prefix, config) for prefix in prefixes)
    except QStreamError:
        raise
    except Exception as exc:  # safetensors reports a bad header with its own exception types
        raise QStreamError(f"{path}: not a readable safetensors file ({exc})") from None
    return CapturedStates(
        name=str(path),
        sha256=_sha256(path),
        streams=streams,
        tokenizer="(token ids from the states file)",
        path=str(path),
        prefixes=prefixes,
    )
