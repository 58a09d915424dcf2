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

from pathlib import Path

import torch

from qstream.arch.dspark_mla.config import DSparkConfig
from qstream.arch.dspark_mla.forward import DSpark
from qstream.arch.dspark_mla.tensors import check_tensors
from qstream.arch.family import borrow_from_target
from qstream.arch.interface import LM_HEAD
from qstream.checkpoint.files import read_config
from qstream.checkpoint.read import read_draft_checkpoint
from qstream.errors import QStreamError

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
    tensors, _ = read_draft_checkpoint(directory)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if EMBED not in shapes:
        shapes[EMBED] = (config.vocab_size, config.hidden_size)  # checked when borrowed
    check_tensors(config, shapes, str(directory))
    return tensors


def load_weights(
    model_dir: str | Path, target: str | Path | None = None, config: DSparkConfig | None = None
) -> dict[str, torch.Tensor]:
    """Everything :class:`DSpark` needs: the draft's tensors (dequantized) plus
    ``lm_head.weight`` (and ``embed_tokens.weight`` if the draft has none) from ``target``,
    which defaults to ``model_dir/target_head`` as written by ``qstream synth``."""
    model_dir = Path(model_dir)
    config = config or load_config(model_dir)
    tensors = read_draft_tensors(model_dir, config)
    borrowed = [LM_HEAD] + ([EMBED] if EMBED not in tensors else [])
    expected = (config.vocab_size, config.hidden_size)
    from_target = borrow_from_target(model_dir, target, borrowed, expected, "lm_head")
    return {**tensors, **from_target}


def load_model(
    model_dir: str | Path, target: str | Path | None = None, dtype: torch.dtype = torch.float32
) -> DSpark:
    """A ready :class:`DSpark` with weights and compute in ``dtype``."""
    config = load_config(model_dir)
    return DSpark(config, load_weights(model_dir, target, config), dtype)
