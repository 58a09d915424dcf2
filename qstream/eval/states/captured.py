"""The corpus every states layout is read into (:class:`CapturedStates`), the two numberings
of the target's layers as :class:`Convention` objects, the one place their names are spelled
(``layer-output``: id j is decoder layer j's output, the draft's ``target_layer_ids``;
``hidden-states-index``: id k is the residual stream entering layer k, vLLM's
``eagle_aux_hidden_state_layer_ids``), and the target's final norm (docs/states.md).  A stream's
rows are read only when a batch asks for them, as float32."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from qstream.arch.weights import rms_norm
from qstream.errors import QStreamError
from qstream.eval.corpus import Corpus

AUX, TARGET = "aux", "target"  # the two kinds of rows a stream source reads


@dataclass(frozen=True)
class Convention:
    """A numbering of the target's layers: id = layer-output id + ``shift``."""

    name: str
    shift: int

    def to_layer_output(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(i - self.shift for i in ids)

    def from_layer_output(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(i + self.shift for i in ids)


LAYER_OUTPUT = Convention("layer-output", 0)
HIDDEN_STATES_INDEX = Convention("hidden-states-index", 1)
CONVENTIONS = {c.name: c for c in (LAYER_OUTPUT, HIDDEN_STATES_INDEX)}


@dataclass(frozen=True)
class FinalNorm:
    """The target's final RMSNorm; ``weight`` None: the identity (states already normalized)."""

    weight: torch.Tensor | None = None
    eps: float = 0.0
    source: str = ""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.weight is None else rms_norm(x.float(), self.weight, self.eps)

    def to_json(self) -> dict | None:
        return None if self.weight is None else {"weight": self.source, "eps": self.eps}


class StreamSource(Protocol):
    """One stream of a states file: its file, the tensor ``kind`` (AUX or TARGET) rows come
    from (for messages), and rows start..stop-1 of ``kind`` as float32."""

    @property
    def where(self) -> str: ...

    def tensor_name(self, kind: str) -> str: ...

    def rows(self, kind: str, start: int, stop: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class CapturedStates(Corpus):
    """A corpus whose aux states and target states come from captured files."""

    sources: tuple[StreamSource, ...] = ()
    details: dict = field(default_factory=dict)  # format, files, layers, final state, manifest
    aux_size: int = 0  # A: the width of every stream's aux rows (checked when read)
    norm: FinalNorm = FinalNorm()  # applied to target rows (identity: already normalized)

    def identity(self) -> dict:
        return {**super().identity(), **self.details}

    def _rows(self, stream: int, kind: str, start: int, stop: int) -> torch.Tensor:
        source = self.sources[stream]
        rows = source.rows(kind, start, stop)
        rows = self.norm(rows) if kind == TARGET else rows
        if not bool(torch.isfinite(rows).all()):
            raise QStreamError(
                f"{source.where}: tensor {source.tensor_name(kind)!r} holds "
                f"non-finite values in positions {start}..{stop - 1}"
            )
        return rows

    def aux_chunks(self, streams: list[int], pad_to: int, dtype: torch.dtype) -> CapturedAuxChunks:
        """Aux states [S, pad_to, A] in ``dtype`` of ``streams``, zero-padded, read a range of
        positions at a time (qstream/arch/interface.py, ``AuxChunks``)."""
        return CapturedAuxChunks(self, streams, pad_to, dtype)

    def target_hidden(
        self, stream: torch.Tensor, anchor: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """``[n, B, H]``: the target's final hidden states at positions p..p+B−1 of each block."""
        out = None
        for s in stream.unique().tolist():
            rows = (stream == s).nonzero().squeeze(1)
            lo, hi = int(anchor[rows].min()), int(anchor[rows].max()) + block_size
            states = self._rows(s, TARGET, lo, hi)
            if out is None:
                out = torch.empty(stream.numel(), block_size, states.shape[-1])
            positions = anchor[rows, None] - lo + torch.arange(block_size)  # [m, B]
            out[rows] = states[positions]
        assert out is not None, "no blocks"
        return out


class CapturedAuxChunks:
    """Aux rows [S, pad_to, A] of some streams, read range by range, zero past each end."""

    def __init__(self, states: CapturedStates, streams: list[int], pad_to: int, dtype: torch.dtype):
        self.states, self.streams, self.dtype = states, streams, dtype
        self.shape = (len(streams), pad_to, states.aux_size)

    def rows(self, t0: int, t1: int) -> torch.Tensor:
        out = torch.zeros(len(self.streams), t1 - t0, self.shape[2], dtype=self.dtype)
        for i, s in enumerate(self.streams):
            stop = min(t1, int(self.states.streams[s].numel()))
            if stop > t0:
                out[i, : stop - t0] = self.states._rows(s, AUX, t0, stop)
        return out
