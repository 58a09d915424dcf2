"""Is each checkpoint what its role in an evaluation says it is (docs/guarantees.md)?

- The ``--model`` is the FP32 reference, so it must be unquantized: a quantized one would make
  its own format look free.  It is refused, pointing to its unquantized base.
- A ``--variant`` must be derived from the ``--model``: quantizing leaves every tensor it does
  not quantize bit-identical (``qstream quantize``, llm-compressor), so any such tensor that
  differs means the variant is another model, and its drift would be meaningless.  It is
  refused unless the user allows foreign variants; then it is labelled ``foreign`` in the
  results and the card.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch

from qstream.arch.registry import load_config
from qstream.checkpoint.files import open_checkpoint
from qstream.checkpoint.safetensors_io import ShardReader
from qstream.errors import QStreamError
from qstream.formats import QUANTIZED_SUFFIXES  # only a quantized module stores these
from qstream.serving import Variant

FOREIGN_FLAG = "--allow-foreign-variant"


def quantized_modules(names) -> set[str]:
    return {n.rpartition(".")[0] for n in names if n.rpartition(".")[2] in QUANTIZED_SUFFIXES}


def refuse_quantized_model(model_dir: str | Path) -> None:
    """QStreamError when ``model_dir`` is a quantized checkpoint (config or tensors say so)."""
    checkpoint = open_checkpoint(model_dir)
    modules = quantized_modules(checkpoint.tensor_shard)
    if "quantization_config" in checkpoint.config:
        why = "its config.json has a quantization_config"
    elif modules:
        why = f"it stores quantized tensors, e.g. {min(modules)}.weight_scale"
    else:
        return
    raise QStreamError(
        f"--model {model_dir} is a quantized checkpoint ({why}); the reference "
        "must be unquantized: pass its unquantized base as --model and this "
        f"directory as --variant NAME={model_dir}"
    )


def foreign_tensors(
    variant_dir: str | Path, model_weights: Mapping[str, torch.Tensor]
) -> list[str]:
    """Tensors the variant keeps unquantized that are not bit-identical to the model's (dtype
    and every bit); tensors the variant lacks (e.g. a borrowed embedding) are not compared."""
    checkpoint = open_checkpoint(variant_dir)
    quantized = quantized_modules(checkpoint.tensor_shard)
    readers = {name: ShardReader(h) for name, h in checkpoint.shards.items()}
    differ = []
    for name, shard in checkpoint.tensor_shard.items():
        if name.rpartition(".")[0] in quantized:
            continue
        ours = model_weights.get(name)
        theirs = readers[shard].tensor(name)
        if ours is None or ours.dtype != theirs.dtype or not torch.equal(ours, theirs):
            differ.append(name)
    return differ


def check_variants_derived(
    variants: tuple[Variant, ...],
    model_dir: str | Path,
    model_weights: Mapping[str, torch.Tensor],
    allow_foreign: bool,
) -> tuple[Variant, ...]:
    """The variants, each checkpoint one checked to be derived from ``model_dir``; a foreign
    one is refused, or with ``allow_foreign`` returned with ``foreign=True``."""
    config = load_config(model_dir)
    out = []
    for variant in variants:
        if not variant.checkpoint:
            out.append(variant)
            continue
        if load_config(variant.source) != config:
            raise QStreamError(
                f"--variant {variant.name}: {variant.source} is a different "
                f"architecture than --model {model_dir} (config.json differs)"
            )
        differ = foreign_tensors(variant.source, model_weights)
        if differ and not allow_foreign:
            raise QStreamError(
                f"--variant {variant.name}: {variant.source} is not derived from --model "
                f"{model_dir}: {len(differ)} tensor(s) it keeps unquantized differ, e.g. "
                f"{differ[0]}; quantizing keeps those bit-identical (use {FOREIGN_FLAG} to "
                "compare it anyway, labelled foreign)"
            )
        out.append(replace(variant, foreign=bool(differ)))
    return tuple(out)
