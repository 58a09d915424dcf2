"""Loading a Hugging Face target from local files, checking the draft against it, and tapping
exactly the layers a draft reads (docs/capture.md), never all N+1 hidden states.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qstream.arch.interface import DraftConfig
from qstream.checkpoint.target import TargetShape
from qstream.errors import QStreamError
from qstream.eval.states.captured import CONVENTIONS
from qstream.serving import DEFAULTS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# a file transformers builds a tokenizer from (without one it builds an empty vocabulary)
TOKENIZER_FILES = ("tokenizer.json", "vocab.*", "*.model", "*.tiktoken")
# the file a tensor of the checkpoint is looked up in: the shard index or the one weights file
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                "pytorch_model.bin")  # fmt: skip
CHUNK = 1 << 24  # elements per finiteness check


@dataclass
class LoadedTarget:
    model: Any  # a transformers PreTrainedModel (AutoModelForCausalLM)
    tokenizer: Any  # a transformers tokenizer (AutoTokenizer)
    device: torch.device  # where inputs go (the first layer's device under --device-map)
    format: str = DEFAULTS["target"]  # or the weight format its decoder linears are served in


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def default_dtype(device: str, device_map: str | None = None) -> str:
    """``--dtype`` left out: float32 on a CPU (bf16 matmuls there are several times slower)."""
    return "float32" if device == "cpu" and device_map is None else "bfloat16"


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """One line naming the first float tensor holding NaN or Inf, checked in chunks."""
    for name, t in tensors:
        flat = t.detach().reshape(-1)
        if t.is_floating_point() and t.device.type != "meta":
            chunks = (flat[i : i + CHUNK].float() for i in range(0, flat.numel(), CHUNK))
            if not all(bool(c.isfinite().all()) for c in chunks):
                raise QStreamError(f"{what} {name} holds NaN or Inf")


@contextmanager
def _quiet() -> Iterator[None]:
    from transformers.utils import logging

    verbosity, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bar:
            logging.enable_progress_bar()


def check_remote_code(target: str | Path, trust_remote_code: bool) -> None:
    """A model_type transformers does not know needs ``--trust-remote-code``."""
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


def _check_loaded(target: str | Path, model: Any, info: dict) -> None:
    """Every tensor of the model read with its shape, no other (transformers fills a missing one
    with random values), all finite."""
    where = next((n for n in WEIGHT_FILES if (Path(target) / n).is_file()), "its weights")
    name = type(model).__name__
    problems = [f"{where} is missing tensor {key} of {name}" for key in info["missing_keys"]]
    problems += [
        f"{where} holds tensor {key}, unknown to {name}" for key in info["unexpected_keys"]
    ]
    problems += [
        f"tensor {key} in {where} has shape {tuple(stored)}, {name} expects {tuple(expected)}"
        for key, stored, expected in info["mismatched_keys"]
    ]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise QStreamError(f"--target {target}: {min(problems)}{more}")
    check_finite(model.named_parameters(), f"--target {target}: weight")


def load_target(
    target: str | Path,
    dtype: torch.dtype,
    device: str = "cpu",
    device_map: str | None = None,
    trust_remote_code: bool = False,
) -> LoadedTarget:
    """The target model (eval mode, no gradients) and its tokenizer, from local files."""
    check_remote_code(target, trust_remote_code)
    if not any(next(Path(target).glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise QStreamError(f"--target {target}: no tokenizer.json (nor vocab.*, *.model): "
                           "the target's tokenizer is missing")  # fmt: skip
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    try:
        with _quiet():
            tokenizer = AutoTokenizer.from_pretrained(str(target), **common)
    except (OSError, ValueError, KeyError) as exc:
        raise QStreamError(f"--target {target}: cannot load its tokenizer: {_first_line(exc)}")
    try:
        with _quiet():
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                str(target), dtype=dtype, device_map=device_map, output_loading_info=True,
                ignore_mismatched_sizes=True, **common
            )  # fmt: skip
    except (OSError, ValueError, KeyError, ImportError, RuntimeError) as exc:
        raise QStreamError(f"--target {target}: cannot load the model: {_first_line(exc)}")
    model, info = loaded
    module: torch.nn.Module = model  # transformers' own typing of .to() confuses mypy
    if device_map is None:
        module.to(torch.device(device))
    _check_loaded(target, model, info)
    module.eval().requires_grad_(False)
    layers, _ = decoder_parts(model)
    first = next(layers[0].parameters(), None)
    return LoadedTarget(
        model, tokenizer, first.device if first is not None else torch.device(device)
    )


def decoder_parts(model: Any) -> tuple[Any, Any]:
    """``(model.model.layers, model.model.norm)`` of a Llama- or DeepSeek-V3-style causal LM."""
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


def cache_keyword(model: Any) -> str:
    """``cache`` in transformers 5, else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def layer_output_ids(ids: list[int], convention: str, depth: int) -> tuple[int, ...]:
    """``--layers`` in qstream's layer-output convention (id j = output of decoder layer j); in
    the hidden-states-index one id k is the output of layer k−1 (docs/capture.md)."""
    if convention not in CONVENTIONS:
        raise QStreamError(f"--layer-convention {convention!r}: choose {' or '.join(CONVENTIONS)}")
    shift = CONVENTIONS[convention].shift
    lo, hi = shift, depth - 1 + shift
    for k in ids:
        if not lo <= k <= hi:
            raise QStreamError(
                f"--layers {k}: outside [{lo}, {hi}] for a target of {depth} layers "
                f"in the {convention} convention"
            )
    return tuple(k - shift for k in ids)


def check_draft(config: DraftConfig, target: TargetShape, layer_ids: tuple[int, ...]) -> None:
    """The draft must fit the target (docs/capture.md)."""
    depth, captured = target.num_hidden_layers, config.num_target_layers
    checks = (
        ("target_hidden_size", config.target_hidden_size, "hidden_size", target.hidden_size),
        ("hidden_size", config.hidden_size, "hidden_size", target.hidden_size),
        ("vocab_size", config.vocab_size, "vocab_size", target.vocab_size),
        ("target_num_hidden_layers", config.target_num_hidden_layers, "num_hidden_layers", depth),
        ("num_target_layers", len(layer_ids), "number of captured layers", captured),
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


class LayerTap:
    """Hooks that keep, per forward, the outputs of ``layers[j]`` for ``j in ids`` and the final
    norm's input and output, moved to the CPU as they come (a ``--device-map`` spread over
    GPUs gathers them in one place); removed on exit, even on error."""

    def __init__(self, layers: Any, norm: Any, ids: tuple[int, ...]):
        self.layers, self.norm, self.ids = layers, norm, ids
        self.outputs: dict[Any, torch.Tensor] = {}  # layer j's; "in" / "out": the final norm's
        self.handles: list[Any] = []

    def __enter__(self) -> LayerTap:
        def keep(key: Any):
            def hook(module, args, output):  # noqa: ARG001 - torch hook signature
                # a decoder layer returns its hidden states, or a tuple whose first item they are
                hidden = output[0] if isinstance(output, tuple) else output
                self.outputs[key] = hidden.detach().to("cpu")
                if key == "out":
                    self.outputs["in"] = args[0].detach().to("cpu")

            return hook

        for j in dict.fromkeys(self.ids):
            self.handles.append(self.layers[j].register_forward_hook(keep(j)))
        self.handles.append(self.norm.register_forward_hook(keep("out")))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _get(self, key: Any) -> torch.Tensor:
        if key not in self.outputs:
            what = "the final norm" if key in ("in", "out") else f"decoder layer {key}"
            raise RuntimeError(f"{what} did not run during the forward")
        return self.outputs[key]

    def aux(self) -> torch.Tensor:
        return torch.cat([self._get(j) for j in self.ids], dim=-1)  # [S, T, L·H]

    def final(self) -> torch.Tensor:
        return self._get("out")  # [S, T, H]

    def pre_norm(self) -> torch.Tensor:
        return self._get("in")  # [S, T, H]

    def layer_stack(self) -> torch.Tensor:
        """``[S, T, L, H]``: the layers' outputs stacked in ids order (vLLM's layout)."""
        return torch.stack([self.outputs[j] for j in self.ids], dim=2)
