"""The states layouts (docs/states.md) as :class:`Layout` objects and their registry, the one
place a layout's name is spelled, with the checks their files share; and the check of a capture
directory against its ``capture.json``.  Opening a file reads headers and token ids only."""

from __future__ import annotations

import gzip
import io
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open

from qstream.arch.interface import DraftConfig
from qstream.checkpoint.safetensors_io import read_header
from qstream.errors import QStreamError
from qstream.eval.states.captured import (
    AUX,
    HIDDEN_STATES_INDEX,
    LAYER_OUTPUT,
    TARGET,
    Convention,
    StreamSource,
)
from qstream.units import FLOAT_DTYPE_NAMES, FLOAT_DTYPES

RECORD = "capture.json"  # written by ``qstream capture`` (qstream/capture/layout.py), read here
Opened = list[tuple[StreamSource, torch.Tensor]]  # a file's streams: (source, token ids)
Tensors = dict[str, torch.Tensor]
ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Layout:
    name: str
    title: str  # for messages
    convention: Convention  # the convention its layer ids are in when nothing else says
    final_tensor: str  # where the final state comes from, as the results name it
    open: Callable[[Path, DraftConfig], Opened]  # validate one file
    # the final state is the last layer's output before the final norm, a slot after the aux
    # layers (index N): normalized when read; capture writes the layer slots [T, L, H] then
    final_before_norm: bool = False
    file_name: str | None = None  # stream i's file as ``qstream capture`` names it (format)
    file_pattern: str | None = None  # those names, the index as group 1
    # capture --export: one stream's file from (ids [T], its aux states, its final state)
    tensors: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Tensors] | None = None

    def stream_file(self, index: int) -> str:
        assert self.file_name is not None, f"{self.name} files are not named by qstream"
        return self.file_name.format(index)

    def stream_index(self, name: str) -> int:
        """The stream index a file name of this layout gives, or -1 for another file."""
        match = None if self.file_pattern is None else re.match(self.file_pattern, name)
        return int(match.group(1)) if match else -1

    def layer_ids(self, ids: tuple[int, ...], depth: int) -> list[int]:
        """The layer-output ``ids`` as its files hold them: in its convention, then the last of
        ``depth`` layers where the final state is a layer slot."""
        slots = (*ids, depth - 1) if self.final_before_norm else tuple(ids)
        return list(self.convention.from_layer_output(slots))


def check_ids(where: str, name: str, ids: torch.Tensor, config: DraftConfig) -> torch.Tensor:
    """A stream's token ids: 1-D int32/int64, long enough for one block, inside the vocab."""
    if ids.dtype not in ID_DTYPES or ids.ndim != 1:
        raise QStreamError(
            f"{where}: tensor {name!r} must be 1-D int32/int64, got "
            f"{str(ids.dtype).removeprefix('torch.')} {list(ids.shape)}"
        )
    T = ids.numel()
    if T < config.block_size + 2:
        raise QStreamError(
            f"{where}: tensor {name!r} has {T} tokens; a block needs at least "
            f"{config.block_size + 2} (one context token, the block, its last "
            "token's successor)"
        )
    if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
        raise QStreamError(
            f"{where}: tensor {name!r} holds ids outside [0, "
            f"{config.vocab_size}) (the model's vocab_size)"
        )
    return ids.long()


def check_float(where: str, name: str, dtype: str | torch.dtype) -> None:
    ok = dtype in FLOAT_DTYPES if isinstance(dtype, torch.dtype) else dtype in FLOAT_DTYPE_NAMES
    if not ok:
        shown = str(dtype).removeprefix("torch.")
        raise QStreamError(
            f"{where}: tensor {name!r} has dtype {shown}, expected one of "
            f"{', '.join(FLOAT_DTYPE_NAMES)}"
        )


def check_shape(where: str, name: str, shape: list[int], expected: list[int], why: str) -> None:
    if list(shape) != list(expected):
        raise QStreamError(
            f"{where}: tensor {name!r} has shape {list(shape)}, expected {list(expected)} ({why})"
        )


def widths(config: DraftConfig) -> dict[str, tuple[int, str]]:
    """Each kind's row width, and why, as the shape messages say it."""
    aux = f"{config.num_target_layers}·{config.target_hidden_size}"
    return {
        AUX: (config.aux_size, f"num_target_layers·target_hidden_size = {aux}"),
        TARGET: (config.hidden_size, "the lm_head's width, hidden_size"),
    }


@contextmanager
def _readable(path: Path) -> Iterator[None]:
    try:
        yield
    except QStreamError:
        raise
    except Exception as exc:  # safetensors reports a bad header with its own exception types
        raise QStreamError(f"{path}: not a readable safetensors file ({exc})") from None


# --- qstream's own: one safetensors file of one stream (input_ids, aux_hidden_states,
# target_hidden_states after the final norm) or several (stream.{i}.<same>, i = 0..S−1)

FIELDS = ("input_ids", "aux_hidden_states", "target_hidden_states")
STREAM_NAME = re.compile(r"stream\.(\d+)\.(\w+)$")
TENSOR_OF = {AUX: "aux_hidden_states", TARGET: "target_hidden_states"}


@dataclass(frozen=True)
class QStreamSource:
    """One stream of a qstream-layout file, its tensors' ``prefix`` "" or "stream.{i}."."""

    where: str
    prefix: str

    def tensor_name(self, kind: str) -> str:
        return self.prefix + TENSOR_OF[kind]

    def rows(self, kind: str, start: int, stop: int) -> torch.Tensor:
        with safe_open(self.where, framework="pt") as f:
            return f.get_slice(self.tensor_name(kind))[start:stop].float()


def _stream_prefixes(path: Path, names: list[str]) -> tuple[str, ...]:
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
    ids_name = prefix + "input_ids"
    ids = check_ids(str(path), ids_name, f.get_tensor(ids_name), config)
    for kind, (width, why) in widths(config).items():
        name = prefix + TENSOR_OF[kind]
        sl = f.get_slice(name)
        shape = [ids.numel(), width]
        check_shape(str(path), name, sl.get_shape(), shape, f"T = len({ids_name}); {why}")
        check_float(str(path), name, sl.get_dtype())
    return ids


def open_qstream_file(path: Path, config: DraftConfig) -> Opened:
    """Validate one qstream-layout file; its streams as (source, token ids)."""
    with _readable(path), safe_open(str(path), framework="pt") as f:
        prefixes = _stream_prefixes(path, sorted(f.keys()))
        ids = [_check_stream(path, f, prefix, config) for prefix in prefixes]
    return [(QStreamSource(str(path), p), i) for p, i in zip(prefixes, ids)]


def qstream_tensors(ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor) -> Tensors:
    """One stream's file (capture writes the single-stream form)."""
    return {
        "input_ids": ids.to(torch.int64).contiguous(),
        "aux_hidden_states": aux.contiguous(),  # [T, L·H]
        "target_hidden_states": final.contiguous(),  # [T, H] after the final norm
    }


# --- vLLM's hidden-state extraction (vLLM 0.32.0's ``ExampleHiddenStatesConnector.
# _submit_async_write``, vllm/distributed/kv_transfer/kv_connector/v1/
# example_hidden_states_connector.py), kept as it is by speculators' offline data generation:
# one file per request of exactly ``token_ids`` [T] and ``hidden_states`` [T, S, H], the S
# layers of ``eagle_aux_hidden_state_layer_ids``; speculators' ``launch_vllm.py`` appends layer
# N (the last layer's output before the final norm) as slot S−1, its trainer's final state.

IDS, STATES = "token_ids", "hidden_states"


@dataclass(frozen=True)
class VllmSource:
    """One request's file: aux rows from slots 0..L−1, target rows from slot L (before the
    final norm, which the corpus applies)."""

    where: str
    n_aux: int

    def tensor_name(self, kind: str) -> str:
        return f"{STATES}[:, :{self.n_aux}]" if kind == AUX else f"{STATES}[:, {self.n_aux}]"

    def rows(self, kind: str, start: int, stop: int) -> torch.Tensor:
        with safe_open(self.where, framework="pt") as f:
            states = f.get_slice(STATES)[start:stop]  # [n, L+1, H]
        if kind == AUX:
            return states[:, : self.n_aux].reshape(states.shape[0], -1).float()
        return states[:, self.n_aux].float()


def _check_slots(path: Path, shape: list[int], T: int, config: DraftConfig) -> None:
    L, H = config.num_target_layers, config.target_hidden_size
    if len(shape) != 3 or shape[0] != T or shape[2] != H:
        check_shape(str(path), STATES, shape, [T, L + 1, H],
                    f"T = len({IDS}); {L} target layers and the final state, "
                    f"each target_hidden_size = {H} wide")  # fmt: skip
    if shape[1] == L:
        raise QStreamError(
            f"{path}: tensor {STATES!r} has {L} layer slots {shape}, the draft's "
            f"{L} target layers but no final state; expected {[T, L + 1, H]} (speculators' "
            "launch_vllm.py appends the last layer with --include-last-layer, its default)"
        )
    check_shape(str(path), STATES, shape, [T, L + 1, H],
                f"{L} target layers (num_target_layers) and the final state")  # fmt: skip
    if H != config.hidden_size:
        raise QStreamError(
            f"{path}: the final state is {H} wide (target_hidden_size) but the lm_head "
            f"is {config.hidden_size} wide (hidden_size)"
        )


def open_vllm_file(path: Path, config: DraftConfig) -> Opened:
    with _readable(path), safe_open(str(path), framework="pt") as f:
        names = sorted(f.keys())
        for name in names:
            if name not in (IDS, STATES):
                raise QStreamError(
                    f"{path}: unexpected tensor {name!r}; vLLM's hidden-states "
                    f"connector writes exactly {IDS!r} and {STATES!r}"
                )
        for name in (IDS, STATES):
            if name not in names:
                raise QStreamError(f"{path}: missing tensor {name!r} (vLLM layout)")
        ids = check_ids(str(path), IDS, f.get_tensor(IDS), config)
        sl = f.get_slice(STATES)
        _check_slots(path, list(sl.get_shape()), ids.numel(), config)
        check_float(str(path), STATES, sl.get_dtype())
    return [(VllmSource(str(path), config.num_target_layers), ids)]


def vllm_tensors(ids: torch.Tensor, layers: torch.Tensor, pre_norm: torch.Tensor) -> Tensors:
    """``hidden_states`` [T, L+1, H]: the aux layers, then the last layer before the norm."""
    return {
        STATES: torch.cat((layers, pre_norm[:, None]), dim=1).contiguous(),
        IDS: ids.to(torch.int64).contiguous(),
    }


# --- SpecForge's ``scripts/prepare_hidden_states.py --strategy dspark``: one ``torch.save`` dict
# per sample, ``rows_{a}-{b}/data_{idx}.ckpt`` (or gzip-compressed ``.ckpt.gz``), loaded with
# ``torch.load(weights_only=True)`` (a pickle that would call code is refused, never run); an
# uncompressed file is memory-mapped, a gzip one decompressed whole (the last two are kept).

SF_IDS, SF_AUX, SF_FINAL = "input_ids", "hidden_states", "target_last_hidden_states"
SF_ALLOWED = (SF_IDS, "loss_mask", SF_AUX, SF_FINAL)
ZIP_MAGIC, GZIP_MAGIC = b"PK\x03\x04", b"\x1f\x8b"


@lru_cache(maxsize=2)
def load_record(path: str) -> dict:
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


@dataclass(frozen=True)
class SpecForgeSource:
    where: str

    def tensor_name(self, kind: str) -> str:
        return SF_AUX if kind == AUX else SF_FINAL

    def rows(self, kind: str, start: int, stop: int) -> torch.Tensor:
        tensor = load_record(self.where)[self.tensor_name(kind)]
        if tensor.ndim == 3:
            tensor = tensor[0]
        return tensor[start:stop].float()


def open_specforge_file(path: Path, config: DraftConfig) -> Opened:
    record = load_record(str(path))
    for name in record:
        if name not in SF_ALLOWED:
            raise QStreamError(
                f"{path}: unexpected entry {name!r}; SpecForge's dspark strategy writes "
                f"{', '.join(SF_ALLOWED)}"
            )
    ids = record.get(SF_IDS)
    if not isinstance(ids, torch.Tensor):
        raise QStreamError(f"{path}: tensor {SF_IDS!r} is missing")
    ids = check_ids(str(path), SF_IDS, ids, config)
    source = SpecForgeSource(str(path))
    for kind, (width, why) in widths(config).items():
        # [1, T, width] (as SpecForge saves it) or [T, width], float
        name = source.tensor_name(kind)
        tensor = record.get(name)
        if not isinstance(tensor, torch.Tensor):
            what = "missing" if tensor is None else f"a {type(tensor).__name__}, not a tensor"
            extra = " (SpecForge writes it with --strategy dspark)" if name == SF_FINAL else ""
            raise QStreamError(f"{path}: tensor {name!r} is {what}{extra}")
        shape = list(tensor.shape)
        check_shape(str(path), name, shape[1:] if len(shape) == 3 and shape[0] == 1 else shape,
                    [ids.numel(), width], f"T = len({SF_IDS}); {why}")  # fmt: skip
        check_float(str(path), name, tensor.dtype)
    return [(source, ids)]


QSTREAM = Layout(
    "qstream", "qstream", LAYER_OUTPUT, "target_hidden_states", open_qstream_file,
    file_name="stream-{:06d}.safetensors", file_pattern=r"^stream-(\d{6,})\.safetensors$",
    tensors=qstream_tensors,
)  # fmt: skip
VLLM = Layout(
    "vllm", "vLLM / speculators", HIDDEN_STATES_INDEX,
    "hidden_states[:, -1] (last layer, before the final norm)", open_vllm_file,
    final_before_norm=True, file_name="hs_{}.safetensors",
    file_pattern=r"^hs_(\d+)\.safetensors$", tensors=vllm_tensors,
)  # fmt: skip
SPECFORGE = Layout(
    "specforge", "SpecForge", LAYER_OUTPUT, "target_last_hidden_states", open_specforge_file
)
LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in (QSTREAM, VLLM, SPECFORGE)}
EXPORTS = tuple(name for name, lay in LAYOUTS.items() if lay.tensors is not None)


def sniff(path: Path) -> Layout:
    """The layout of one file, from its first bytes and (safetensors) its tensor names."""
    with path.open("rb") as fh:
        head = fh.read(4)
    if head == ZIP_MAGIC or head[:2] == GZIP_MAGIC or head[:1] == b"\x80":
        return SPECFORGE  # a torch.save zip or pickle, plain or gzip-compressed
    names = set(read_header(path).tensors)
    if names & {IDS, STATES}:
        return VLLM
    if "input_ids" in names or any(n.startswith("stream.") for n in names):
        return QSTREAM
    shown = ", ".join(sorted(names)[:4]) or "none"
    raise QStreamError(
        f"{path}: not a states file qstream knows (tensors: {shown}); expected qstream's "
        "input_ids/aux_hidden_states/target_hidden_states, vLLM's token_ids/hidden_states, "
        "or a SpecForge .ckpt (docs/states.md)"
    )


# --- A capture directory checked against its capture.json before any block runs (docs/capture.md,
# docs/guarantees.md): the sha256 of every stream file (``files``), else (a capture written before
# sha256s were recorded) their count and names (``streams``); one that records neither (written by
# hand) is not checked, and the results say so.

RESUME = "resume the capture (qstream capture, same settings)"


def check_manifest(root: Path, manifest: dict, digests: dict[str, str]) -> dict:
    """Check the states files of ``root`` (``digests``: relative name -> sha256) against
    ``manifest``; returns what was checked, as the results record it."""
    where = root / RECORD
    recorded = manifest.get("files")
    if recorded is not None:
        if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
            raise QStreamError(f"{where}: 'files' is not a map of file name -> sha256")
        _same_names(root, list(recorded), digests, f"{len(recorded)} streams")
        for name, digest in recorded.items():
            if digests[name] != digest:
                raise QStreamError(
                    f"{root / name}: sha256 {digests[name][:12]}... differs from "
                    f"{digest[:12]}... recorded in {where} (changed since capture wrote it)"
                )
        return {"streams": len(recorded), "sha256": "checked"}
    count, name = manifest.get("streams"), manifest.get("layout")
    layout = LAYOUTS.get(name) if isinstance(name, str) else None  # any JSON value
    if count is None:
        return {"streams": "not recorded", "sha256": "not recorded"}
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise QStreamError(f"{where}: 'streams' is {count!r}, not a count of stream files")
    if layout is not None and layout.file_name is not None:
        names = [layout.stream_file(i) for i in range(count)]
        _same_names(root, names, digests, f"{count} streams")
    elif len(digests) != count:
        raise QStreamError(
            f"--states {root}: holds {len(digests)} states files, but {where} records "
            f"{count} streams"
        )
    return {"streams": count, "sha256": "not recorded"}


def _same_names(root: Path, recorded: list[str], digests: dict[str, str], what: str) -> None:
    where = root / RECORD
    missing = [name for name in recorded if name not in digests]
    if missing:
        raise QStreamError(
            f"{root / missing[0]}: missing, but {where} records it (one of {what}); {RESUME} "
            "to write it again"
        )
    unrecorded = sorted(set(digests) - set(recorded))
    if unrecorded:
        raise QStreamError(
            f"{root / unrecorded[0]}: a states file {where} does not record ({what}); {RESUME} "
            "to record it, or move it out"
        )
