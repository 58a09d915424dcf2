"""Loading a Hugging Face target for capture and checking the draft against it
(docs/capture.md).  Everything is read from local files (``local_files_only``); code shipped
with a checkpoint runs only with ``trust_remote_code``.

>>> target = load_target("TARGET_DIR", dtype=torch.float32, device="cpu")
>>> layers, norm = decoder_parts(target.model)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qstream.arch.interface import DraftConfig
from qstream.checkpoint.target import TargetShape
from qstream.errors import QStreamError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONVENTIONS = ("layer-output", "hidden-states-index")


@dataclass
class LoadedTarget:
    model: Any  # a transformers PreTrainedModel (AutoModelForCausalLM)
    tokenizer: Any  # a transformers tokenizer (AutoTokenizer)
    device: torch.device  # where inputs go (the first layer's device under --device-map)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def check_remote_code(target: str | Path, trust_remote_code: bool) -> None:
    """A config that maps to code shipped with the checkpoint (``auto_map``) and names a
    model_type transformers does not know needs ``--trust-remote-code``: one line, not a
    traceback from inside transformers."""
    if trust_remote_code:
        return
    from transformers import CONFIG_MAPPING

    config = json.loads((Path(target) / "config.json").read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        hint = " (its config.json has an auto_map)" if "auto_map" in config else ""
        raise QStreamError(
            f"--target {target}: model_type {model_type!r} is not built into transformers"
            f"{hint}; pass --trust-remote-code to run the checkpoint's own code"
        )


def load_target(
    target: str | Path,
    dtype: torch.dtype,
    device: str = "cpu",
    device_map: str | None = None,
    trust_remote_code: bool = False,
) -> LoadedTarget:
    """The target model (eval mode, no gradients) and its tokenizer, from local files."""
    check_remote_code(target, trust_remote_code)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(target), **common)
    except (OSError, ValueError, KeyError) as exc:
        raise QStreamError(f"--target {target}: cannot load its tokenizer: {_first_line(exc)}")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(target), dtype=dtype, device_map=device_map, **common
        )
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise QStreamError(f"--target {target}: cannot load the model: {_first_line(exc)}")
    module: torch.nn.Module = model  # transformers' own typing of .to() confuses mypy
    if device_map is None:
        module.to(torch.device(device))
    module.eval().requires_grad_(False)
    layers, _ = decoder_parts(model)
    first = next(layers[0].parameters(), None)
    return LoadedTarget(
        model, tokenizer, first.device if first is not None else torch.device(device)
    )


def decoder_parts(model: Any) -> tuple[Any, Any]:
    """``(decoder layers, final norm)`` of a Llama- or DeepSeek-V3-style causal LM
    (``model.model.layers``, ``model.model.norm``); a one-line error for other layouts."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    norm = getattr(base, "norm", None)
    if not isinstance(layers, torch.nn.ModuleList) or not isinstance(norm, torch.nn.Module):
        raise QStreamError(
            f"cannot find the decoder layers (model.model.layers) and final norm "
            f"(model.model.norm) of {type(model).__name__}; capture supports Llama- and "
            "DeepSeek-V3-style models"
        )
    return layers, norm


def layer_output_ids(ids: list[int], convention: str, depth: int) -> tuple[int, ...]:
    """``--layers`` in qstream's layer-output convention (id j = output of decoder layer j).
    In the hidden-states-index convention id k is the residual stream entering layer k, the
    output of layer k−1 (docs/capture.md), so k = 0 (the embeddings) has no layer-output id."""
    if convention not in CONVENTIONS:
        raise QStreamError(f"--layer-convention {convention!r}: choose {' or '.join(CONVENTIONS)}")
    shift = 1 if convention == "hidden-states-index" else 0
    lo, hi = shift, depth - 1 + shift
    for k in ids:
        if not lo <= k <= hi:
            raise QStreamError(
                f"--layers {k}: outside [{lo}, {hi}] for a target of {depth} layers "
                f"in the {convention} convention"
            )
    return tuple(k - shift for k in ids)


def check_draft(config: DraftConfig, target: TargetShape, layer_ids: tuple[int, ...]) -> None:
    """The draft must fit the target: one line naming the first mismatch (docs/capture.md)."""
    checks = (
        ("target_hidden_size", config.target_hidden_size, "hidden_size", target.hidden_size),
        ("hidden_size", config.hidden_size, "hidden_size", target.hidden_size),
        ("vocab_size", config.vocab_size, "vocab_size", target.vocab_size),
        (
            "target_num_hidden_layers",
            config.target_num_hidden_layers,
            "num_hidden_layers",
            target.num_hidden_layers,
        ),
        (
            "num_target_layers",
            len(layer_ids),
            "number of captured layers",
            config.num_target_layers,
        ),
    )
    for mine, value, theirs, expected in checks:
        if value is not None and value != expected:  # None: a config that does not say
            raise QStreamError(
                f"draft {mine} = {value} does not match the target's {theirs} = {expected} "
                f"({target.path})"
            )
    for j in layer_ids:
        if not 0 <= j < target.num_hidden_layers:
            raise QStreamError(
                f"layer id {j} is not a layer of the target ({target.path} has "
                f"num_hidden_layers = {target.num_hidden_layers}, ids 0..{target.num_hidden_layers - 1})"
            )
