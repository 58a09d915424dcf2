"""The corpus every states layout is read into (:class:`CapturedStates`), the checks all layouts
share, and which target layers a states file holds: the two numberings as :class:`Convention`
objects, the one place their names are spelled (``layer-output``: id j is decoder layer j's
output, the draft's ``target_layer_ids``; ``hidden-states-index``: id k is the residual stream
entering layer k, vLLM's ``eagle_aux_hidden_state_layer_ids``), and the target's final norm
(docs/states.md).  A stream's rows are read only when a batch asks for them, as float32."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from qstream.arch.interface import DraftConfig
from qstream.arch.weights import rms_norm
from qstream.checkpoint.files import read_config, sha256_file
from qstream.checkpoint.read import read_target_tensors
from qstream.checkpoint.target import read_target_shape
from qstream.errors import QStreamError
from qstream.eval.corpus import AnchorPlan, Corpus

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
FINAL_NORM = "model.norm.weight"  # the final norm of a transformers decoder (not a layer's norm)


def parse_convention(value: object, where: str) -> Convention:
    name = value.replace("_", "-") if isinstance(value, str) else None
    if name not in CONVENTIONS:
        raise QStreamError(
            f"{where}: layer convention {value!r} is not one of {', '.join(CONVENTIONS)}"
        )
    return CONVENTIONS[name]


def parse_ids(value: object, where: str) -> tuple[int, ...]:
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if not all(p.isdigit() for p in parts):
            raise QStreamError(f"{where}: layer ids {value!r} are not comma-separated integers")
        value = [int(p) for p in parts]
    if not (
        isinstance(value, list | tuple)
        and value
        and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    ):
        raise QStreamError(f"{where}: layer ids {value!r} are not a list of integers")
    return tuple(value)


def target_depth(config: DraftConfig, target: str | None) -> int | None:
    """The target's layer count: the draft's ``target_num_hidden_layers``, else (a speculators
    draft has none) ``target``'s config.json."""
    if config.target_num_hidden_layers is not None or target is None:
        return config.target_num_hidden_layers
    return read_target_shape(target).num_hidden_layers


def check_layer_ids(
    ids: tuple[int, ...], convention: Convention, config: DraftConfig, where: str, n: int | None
):
    """Refuse ids that are not the draft's ``target_layer_ids``; a trailing last layer (output
    ``n`` − 1) names the final state and is allowed."""
    wanted = tuple(config.target_layer_ids)
    lo = convention.to_layer_output(ids)
    if len(lo) == len(wanted) + 1 and n is not None and lo[-1] == n - 1:
        lo = lo[:-1]  # speculators appends the last layer (its final state)
    if lo != wanted:
        raise QStreamError(
            f"{where}: layer ids {list(ids)} ({convention.name}) are layers {list(lo)} in the "
            f"layer-output convention; the draft's target_layer_ids are {list(wanted)} "
            + (
                f"(the target's {n} layers)"
                if n
                else "(the target's layer count unknown: pass "
                "--target, whose config.json has num_hidden_layers)"
            )
        )


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


def read_final_norm(target: str | None, width: int, why: str) -> FinalNorm:
    if target is None:
        raise QStreamError(
            f"{why}: its final state is taken before the target's final norm; pass --target "
            f"HF_DIR (the target checkpoint: its {FINAL_NORM} and config.json rms_norm_eps) "
            "to normalize it"
        )
    weight = read_target_tensors(target, [FINAL_NORM])[FINAL_NORM]
    if list(weight.shape) != [width]:
        raise QStreamError(
            f"{target}: {FINAL_NORM} has shape {list(weight.shape)}, expected [{width}] "
            "(the final state's width)"
        )
    config = read_config(Path(target))
    eps = config.get("rms_norm_eps", (config.get("text_config") or {}).get("rms_norm_eps"))
    if not isinstance(eps, int | float) or isinstance(eps, bool) or not eps > 0:
        raise QStreamError(
            f"{Path(target) / 'config.json'}: rms_norm_eps = {eps!r}, expected a positive "
            "number (the final norm's epsilon)"
        )
    return FinalNorm(weight.float(), float(eps), f"{target}:{FINAL_NORM}")


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

    def block_tokens(self, plan: AnchorPlan, block_size: int) -> torch.Tensor:
        """``[N, B]`` the stream's own tokens p+1..p+B of every block of ``plan``."""
        return torch.stack(
            [
                self.streams[s][p + 1 : p + 1 + block_size]
                for s, p in zip(plan.stream.tolist(), plan.anchor.tolist())
            ]
        )


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


def file_sha256s(files: list[Path], root: Path) -> dict[str, str]:
    """``{name relative to root: sha256}`` of each states file (a file given alone: its name)."""
    return {f.name if f == root else f.relative_to(root).as_posix(): sha256_file(f) for f in files}


def files_sha256(digests: dict[str, str], root: Path) -> str:
    """sha256 of one file, or of a directory's files (relative name and each file's sha256)."""
    if root.is_file():
        return next(iter(digests.values()))
    digest = hashlib.sha256()
    for name, file_digest in digests.items():
        digest.update(f"{name}\0{file_digest}\n".encode())
    return digest.hexdigest()
