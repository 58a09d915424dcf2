"""A Hugging Face style checkpoint directory: ``config.json``, its safetensors shards (through
``model.safetensors.index.json`` when there is one), and every other file.  Opening one reads
and validates all headers and the index; no tensor data is touched."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from qstream.checkpoint.safetensors_io import ShardHeader, ShardReader, TensorInfo, read_header
from qstream.errors import QStreamError

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class Checkpoint:
    directory: Path
    config: dict
    shards: dict[str, ShardHeader]  # file name -> header, in shard order
    tensor_shard: dict[str, str]  # tensor name -> file name
    has_index: bool

    def info(self, name: str) -> TensorInfo:
        return self.shards[self.tensor_shard[name]].tensors[name]

    @cached_property
    def readers(self) -> dict[str, ShardReader]:
        """One memory map per shard, opened on first use."""
        return {name: ShardReader(header) for name, header in self.shards.items()}

    def tensor(self, name: str, rows: slice | None = None) -> torch.Tensor:
        return self.readers[self.tensor_shard[name]].tensor(name, rows)

    def release(self, name: str, rows: slice | None = None) -> None:
        self.readers[self.tensor_shard[name]].release(name, rows)

    @property
    def attention_layers(self) -> list[str]:
        """``....self_attn`` modules holding a tensor, in checkpoint order."""
        attn = ".self_attn."
        return list(
            dict.fromkeys(
                n[: n.index(attn) + len(attn) - 1] for n in self.tensor_shard if attn in n
            )
        )

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return {name: self.info(name) for name in self.tensor_shard}

    @property
    def weight_files(self) -> set[str]:
        return set(self.shards) | ({INDEX_NAME} if self.has_index else set())

    @property
    def size_bytes(self) -> int:
        return sum(h.file_size for h in self.shards.values())


def read_json(path: Path, what: str, object_pairs_hook=None):
    try:
        return json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=object_pairs_hook)
    except FileNotFoundError:
        raise QStreamError(f"{path}: missing {what}") from None
    except OSError as exc:
        raise QStreamError(f"{path}: cannot read {what}: {exc.strerror}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QStreamError(f"{path}: {what} is not valid JSON ({exc})") from exc


def read_config(directory: Path) -> dict:
    config = read_json(directory / CONFIG_NAME, "config.json")
    if not isinstance(config, dict):
        raise QStreamError(f"{directory / CONFIG_NAME}: not a JSON object")
    return config


def open_checkpoint(directory: str | Path) -> Checkpoint:
    directory = Path(directory)
    if not directory.is_dir():
        raise QStreamError(f"{directory}: not a directory")
    config = read_config(directory)
    index_path = directory / INDEX_NAME
    if index_path.exists():
        weight_map = _read_index(index_path)
        names = list(dict.fromkeys(weight_map.values()))
    else:
        weight_map = None
        names = sorted(p.name for p in directory.glob("*.safetensors") if p.is_file())
        if not names:
            raise QStreamError(f"{directory}: no *.safetensors files and no {INDEX_NAME}")
    shards = {}
    for name in names:
        if not (directory / name).is_file():
            raise QStreamError(f"{index_path}: names shard {name!r}, which does not exist")
        shards[name] = read_header(directory / name)
    tensor_shard: dict[str, str] = {}
    for shard, header in shards.items():
        for tensor in header.tensors:
            if tensor in tensor_shard:
                raise QStreamError(
                    f"tensor {tensor!r} is in two shards: {tensor_shard[tensor]} and {shard}"
                )
            tensor_shard[tensor] = shard
    if weight_map is not None:
        for tensor, shard in weight_map.items():
            actual = tensor_shard.get(tensor)
            if actual is None:
                raise QStreamError(
                    f"{index_path}: tensor {tensor!r} is mapped to {shard}, which does not "
                    "contain it"
                )
            if actual != shard:
                raise QStreamError(
                    f"{index_path}: tensor {tensor!r} is mapped to {shard} but is in {actual}"
                )
        extra = [t for t in tensor_shard if t not in weight_map]
        if extra:
            raise QStreamError(
                f"{index_path}: tensor {extra[0]!r} (in {tensor_shard[extra[0]]}) is missing "
                "from the index"
            )
        tensor_shard = {t: tensor_shard[t] for t in weight_map}
    return Checkpoint(directory, config, shards, tensor_shard, weight_map is not None)


def _read_index(path: Path) -> dict[str, str]:
    def no_duplicate_keys(pairs):  # json keeps the last of a key given twice, silently
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise QStreamError(
                    f"{path}: {key!r} appears twice (mapped to {seen[key]!r} and {value!r})"
                )
            seen[key] = value
        return seen

    index = read_json(path, "safetensors index", no_duplicate_keys)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise QStreamError(f"{path}: no weight_map of tensor name -> shard file")
    for tensor, shard in weight_map.items():
        if Path(shard).name != shard:
            raise QStreamError(
                f"{path}: tensor {tensor!r} names shard {shard!r} outside the checkpoint directory"
            )
    return weight_map


def file_digests(directory: Path, known: dict[str, str]) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``directory``, sorted; what quantize
    records and verify checks (docs/guarantees.md).  ``known``: digests already computed
    (quantize hashes its shards as it writes them), taken as they are."""
    digests = {}
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        digests[name] = known[name] if name in known else sha256_file(path)
    return digests


def sha256_file(path: Path) -> str:
    """The sha256 of one file, read once in chunks (a shard of any size)."""
    with Path(path).open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
