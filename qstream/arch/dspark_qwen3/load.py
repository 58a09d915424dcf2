"""Loading a Qwen3-style DSpark draft: strict, memory-mapped, quantized checkpoints
dequantized; what the draft does not carry is borrowed from its target (docs/qwen3-dspark.md,
"Loading"), as vLLM 0.32.0 shares it (``Qwen3DSparkForCausalLM.load_weights``).

>>> weights = load_weights("draft/", None, config)   # borrowed from draft/target_head/
>>> weights = load_weights("draft-nvfp4/", "Qwen3-8B/", config)
"""

from __future__ import annotations

from pathlib import Path

import torch

from qstream.arch.dspark_qwen3.config import Qwen3DSparkConfig
from qstream.arch.dspark_qwen3.tensors import EMBED, LM_HEAD, T2D, check_tensors
from qstream.arch.family import D2T, borrow_from_target, d2t_problem
from qstream.checkpoint.files import read_config
from qstream.checkpoint.read import read_draft_checkpoint, read_target_tensors
from qstream.errors import QStreamError

INDEX_TENSORS = {D2T: (torch.int64, torch.int32), T2D: (torch.bool, torch.uint8)}


def read_draft_tensors(directory: str | Path, config: Qwen3DSparkConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the draft checkpoint, quantized ones dequantized, strictly checked
    against the config (``embed_tokens`` may be absent; the target's is then shared)."""
    directory = Path(directory)
    tensors, index = read_draft_checkpoint(directory, INDEX_TENSORS)
    for name, tensor in index.items():
        if name != D2T and tensor.dtype not in INDEX_TENSORS[name]:  # d2t: d2t_problem
            raise QStreamError(f"{directory}: tensor {name!r} is {tensor.dtype}, not an index map")
    check_tensors(
        config, {k: tuple(v.shape) for k, v in {**tensors, **index}.items()}, str(directory)
    )
    if D2T in index:
        if problem := d2t_problem(index[D2T], config.vocab_size):
            raise QStreamError(f"{directory}: {problem}")
        tensors[D2T] = index[D2T].long()
    return tensors


def load_weights(
    model_dir: str | Path, target: str | Path | None, config: Qwen3DSparkConfig
) -> dict[str, torch.Tensor]:
    """Everything :class:`~qstream.arch.dspark_qwen3.forward.Qwen3DSpark` needs: the draft's
    tensors plus, from ``target`` (default ``model_dir/target_head``), ``embed_tokens.weight``
    when the draft has none and ``lm_head.weight`` when the draft has no lm_head of its own
    (a target with tied embeddings lends its embedding)."""
    model_dir = Path(model_dir)
    tensors = read_draft_tensors(model_dir, config)
    wanted = [n for n in (EMBED, LM_HEAD) if n not in tensors]
    if not wanted:
        return tensors
    expected = (config.vocab_size, config.hidden_size)
    missing = " or ".join(wanted)
    borrowed = borrow_from_target(model_dir, target, wanted, expected, missing, _read_borrowed)
    return {**tensors, **borrowed}


def _read_borrowed(target: Path, wanted: list[str]) -> dict[str, torch.Tensor]:
    """``wanted`` from the target; a target whose config.json ties its word embeddings has
    no lm_head tensor and lends embed_tokens for it."""
    tied = (target / "config.json").exists() and read_config(target).get("tie_word_embeddings")
    if tied and LM_HEAD in wanted:
        out = read_target_tensors(target, [EMBED])
        return {n: out[EMBED] for n in wanted}
    return read_target_tensors(target, wanted)
