"""Loading a DSpark-MLA draft: strict, memory-mapped, quantized checkpoints dequantized, the
target's lm_head borrowed.

>>> model = load_model("ckpt/", dtype=torch.float32)            # target head: ckpt/target_head/
>>> model = load_model("ckpt-nvfp4/", target="kimi-k3/", dtype=torch.bfloat16)
>>> weights = load_weights("ckpt/")                              # name -> tensor, lm_head included

Tensors are read through the project's safetensors reader (qstream.checkpoint), which memory
maps each shard and checks every header; a target is opened through its
``model.safetensors.index.json`` and only the shard holding the borrowed tensors is touched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from qstream.arch.dspark_mla.config import DSparkConfig
from qstream.arch.dspark_mla.forward import DSpark
from qstream.arch.dspark_mla.tensors import check_tensors
from qstream.arch.interface import LM_HEAD, TARGET_HEAD_DIR
from qstream.checkpoint.files import INDEX_NAME, open_checkpoint, read_config, read_json
from qstream.checkpoint.layout import format_of_layout
from qstream.checkpoint.safetensors_io import ShardReader, read_header
from qstream.errors import QStreamError
from qstream.formats import FORMATS, dequantize
from qstream.units import FLOAT_DTYPES

EMBED = "embed_tokens.weight"


def load_config(directory: str | Path) -> DSparkConfig:
    """config.json of a draft checkpoint -> DSparkConfig (QStreamError naming key and value)."""
    directory = Path(directory)
    try:
        return DSparkConfig.from_json(read_config(directory))
    except ValueError as exc:
        raise QStreamError(
            f"{directory / 'config.json'}: {exc}".replace(
                "config.json: config.json:", "config.json:"
            )
        ) from None


def read_draft_tensors(
    directory: str | Path, config: DSparkConfig | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the draft checkpoint, quantized ones dequantized (4-bit formats to
    bf16, FP8 to its scale's dtype), strictly checked against the config: nothing missing,
    nothing unexplained, every shape exact.  ``embed_tokens.weight`` may be absent (then it
    must come from the target)."""
    directory = Path(directory)
    config = config or load_config(directory)
    checkpoint = open_checkpoint(directory)
    readers = {name: ShardReader(h) for name, h in checkpoint.shards.items()}
    raw = {n: readers[s].tensor(n) for n, s in checkpoint.tensor_shard.items()}
    fmt = _checkpoint_format(directory, checkpoint.config)
    tensors = _dequantize_all(raw, fmt, str(directory))
    for name, tensor in tensors.items():
        if tensor.dtype not in FLOAT_DTYPES:
            raise QStreamError(
                f"{directory}: tensor {name!r} is {tensor.dtype}, not a float "
                "weight (quantized data the config does not declare?)"
            )
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if EMBED not in shapes:
        shapes[EMBED] = (config.vocab_size, config.hidden_size)  # checked when borrowed
    check_tensors(config, shapes, str(directory))
    return tensors


def _checkpoint_format(directory: Path, config: dict) -> str | None:
    qc = config.get("quantization_config")
    if qc is None:
        return None
    layout = qc.get("format") if isinstance(qc, dict) else None
    fmt = format_of_layout(layout) if isinstance(layout, str) else None
    if fmt is None:
        raise QStreamError(
            f"{directory / 'config.json'}: quantization_config.format = "
            f"{layout!r} is not one of "
            f"{', '.join(s.layout for s in FORMATS.values())}"
        )
    return fmt


def _dequantize_all(
    raw: Mapping[str, torch.Tensor], fmt: str | None, where: str
) -> dict[str, torch.Tensor]:
    """Replace each quantized module's stored tensors by its dequantized ``.weight``."""
    stored_suffixes = set(FORMATS[fmt].stored) - {"weight"} if fmt else set()
    modules: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        module, _, suffix = name.rpartition(".")
        if suffix in stored_suffixes or (
            suffix == "weight"
            and f"{module}.weight_scale" in raw
            and fmt is not None
            and "weight" in FORMATS[fmt].stored
        ):
            modules.setdefault(module, {})[suffix] = tensor
        elif suffix in ("weight_packed", "weight_scale", "weight_global_scale"):
            raise QStreamError(
                f"{where}: tensor {name!r} is quantization data, but the "
                f"config declares {'no' if fmt is None else fmt} quantization "
                "for it"
            )
        else:
            out[name] = tensor
    for module, stored in modules.items():
        assert fmt is not None  # modules are collected only under a quantization config
        missing = [s for s in FORMATS[fmt].stored if s not in stored]
        if missing:
            raise QStreamError(
                f"{where}: quantized module {module!r} lacks "
                f"{module}.{missing[0]} ({fmt} stores "
                f"{', '.join(FORMATS[fmt].stored)})"
            )
        try:
            out[f"{module}.weight"] = dequantize(fmt, stored)
        except (RuntimeError, ValueError) as exc:
            raise QStreamError(f"{where}: cannot dequantize {module!r} as {fmt}: {exc}") from None
    return out


def read_target_tensors(target: str | Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read only ``names`` (``lm_head.weight``, ``embed_tokens.weight``) from a target
    checkpoint.  A target tensor matches a name when it is equal to it or ends with
    ``.<name>`` (``model.embed_tokens.weight``, ``language_model.lm_head.weight``); exactly one
    match is required.  With an index only the shards holding the matches are opened."""
    target = Path(target)
    index = target / INDEX_NAME
    if index.exists():
        data = read_json(index, "safetensors index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise QStreamError(f"{index}: no weight_map of tensor name -> shard file")
    else:
        shards = sorted(p.name for p in target.glob("*.safetensors"))
        if not shards:
            raise QStreamError(f"{target}: no {INDEX_NAME} and no *.safetensors files")
        weight_map = {t: s for s in shards for t in read_header(target / s).tensors}
    fmt = (
        _checkpoint_format(target, read_config(target))
        if (target / "config.json").exists()
        else None
    )
    out, readers = {}, {}
    for name in names:
        source = _match_one(weight_map, name, target)
        module = source[: -len(".weight")]
        wanted = {source} | {
            f"{module}.{s}"
            for s in ("weight_scale", "weight_packed", "weight_global_scale")
            if f"{module}.{s}" in weight_map
        }
        raw = {}
        for t in wanted:
            shard = weight_map[t]
            if shard not in readers:
                if Path(shard).name != shard or not (target / shard).is_file():
                    raise QStreamError(
                        f"{target}: tensor {t!r} is mapped to missing shard {shard!r}"
                    )
                readers[shard] = ShardReader(read_header(target / shard))
            if t not in readers[shard].header.tensors:
                raise QStreamError(f"{target / shard}: does not contain {t!r} (index says so)")
            raw[t.replace(module, name[: -len(".weight")], 1)] = readers[shard].tensor(t)
        out.update(_dequantize_all(raw, fmt if len(raw) > 1 else None, str(target)))
    return out


def _match_one(weight_map: Mapping[str, str], name: str, target: Path) -> str:
    if name in weight_map:
        return name
    hits = [t for t in weight_map if t.endswith("." + name)]
    if len(hits) != 1:
        found = "none" if not hits else ", ".join(hits[:4])
        raise QStreamError(
            f"{target}: need exactly one tensor named {name!r} or ending in "
            f"'.{name}'; found {found}"
        )
    return hits[0]


def load_weights(
    model_dir: str | Path, target: str | Path | None = None, config: DSparkConfig | None = None
) -> dict[str, torch.Tensor]:
    """Everything :class:`DSpark` needs: the draft's tensors (dequantized) plus
    ``lm_head.weight`` (and ``embed_tokens.weight`` if the draft has none) from ``target``,
    which defaults to ``model_dir/target_head`` as written by ``qstream synth``."""
    model_dir = Path(model_dir)
    config = config or load_config(model_dir)
    tensors = read_draft_tensors(model_dir, config)
    if target is None:
        target = model_dir / TARGET_HEAD_DIR
        if not target.is_dir():
            raise QStreamError(
                f"{model_dir}: the draft has no lm_head of its own; pass the "
                f"target checkpoint (--target DIR) or add {TARGET_HEAD_DIR}/"
            )
    borrowed = [LM_HEAD] + ([EMBED] if EMBED not in tensors else [])
    from_target = read_target_tensors(target, borrowed)
    expected = (config.vocab_size, config.hidden_size)
    for name, tensor in from_target.items():
        if tuple(tensor.shape) != expected:
            raise QStreamError(
                f"{target}: {name} has shape {list(tensor.shape)}, the draft needs {list(expected)}"
            )
    return {**tensors, **from_target}


def load_model(
    model_dir: str | Path, target: str | Path | None = None, dtype: torch.dtype = torch.float32
) -> DSpark:
    """A ready :class:`DSpark` with weights and compute in ``dtype``."""
    config = load_config(model_dir)
    return DSpark(config, load_weights(model_dir, target, config), dtype)
