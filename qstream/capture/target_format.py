"""The target served quantized (docs/capture.md, "A quantized target"): every decoder
``nn.Linear`` gets its stored weight quantized and dequantized (qstream/formats/), as vLLM
loads an llm-compressor checkpoint of that format; lm_head and the embeddings stay as stored,
and fused NVFP4 projections share one global scale (``qstream.vllm.profiles.fused_groups``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qstream.capture.target import decoder_parts
from qstream.checkpoint.files import open_checkpoint
from qstream.checkpoint.safetensors_io import ShardReader
from qstream.errors import QStreamError
from qstream.formats import dequantize, get_format, quantize
from qstream.formats.format import check_finite, check_weight
from qstream.formats.nvfp4 import tensor_amax
from qstream.quant.select import share_group_amax
from qstream.serving import TARGETS
from qstream.vllm.profiles import fused_groups


def check_target_format(fmt: str, option: str) -> None:
    if fmt not in TARGETS:
        raise QStreamError(f"{option} {fmt!r}: choose one of {', '.join(TARGETS)}")


@torch.no_grad()
def simulate_target(model: Any, target: str | Path, fmt: str) -> list[str]:
    """Put into ``model`` each decoder Linear's stored weight quantized to ``fmt`` and dequantized
    in the stored dtype; returns the modules changed."""
    layers, _ = decoder_parts(model)
    prefix = next(name for name, module in model.named_modules() if module is layers) + "."
    # a module transformers does not build as a Linear (transformers 5's fused MoE experts) is
    # not one of them
    linears = {
        name: module
        for name, module in model.named_modules()
        if name.startswith(prefix) and isinstance(module, torch.nn.Linear)
    }
    checkpoint = open_checkpoint(target)
    readers: dict[str, ShardReader] = {}
    stored = {}  # each weight as the checkpoint stores it (its dtype, mapped, not copied)
    for module in linears:
        name = f"{module}.weight"
        shard = checkpoint.tensor_shard.get(name)
        if shard is None:
            raise QStreamError(f"--target {target}: holds no tensor {name}, the weight of the "
                               f"model's Linear {module}")  # fmt: skip
        if shard not in readers:
            readers[shard] = ShardReader(checkpoint.shards[shard])
        stored[module] = readers[shard].tensor(name)
    spec = get_format(fmt)
    amaxes: dict[str, torch.Tensor] = {}
    for module, w in stored.items():  # every weight checked before any is changed
        name = f"--target-format {fmt}: {target}: {module}.weight"
        check_weight(w, name, spec.block_size or 1)
        check_finite(amaxes.setdefault(module, tensor_amax(w)), name)
    amax = share_group_amax(amaxes, fused_groups(stored)) if spec.global_scale else {}
    for module, w in stored.items():
        codes = quantize(fmt, w, name=f"{module}.weight", global_amax=amax.get(module))
        linears[module].weight.copy_(dequantize(fmt, codes, dtype=w.dtype))
    return list(stored)
