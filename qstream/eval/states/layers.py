"""Which target layers a states file holds, in which numbering, and the target's final norm.
The two numberings as :class:`Convention` objects and their registry, the one place their names
are spelled (``layer-output``: id j is decoder layer j's output, the draft's own
``target_layer_ids``; ``hidden-states-index``: id k is the residual stream entering layer k,
vLLM's ``eagle_aux_hidden_state_layer_ids``); their vLLM sources: docs/states.md, "Layer ids".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from qstream.arch.interface import DraftConfig
from qstream.checkpoint.files import read_config
from qstream.checkpoint.read import read_target_tensors
from qstream.checkpoint.target import read_target_shape
from qstream.errors import QStreamError


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
    """A convention by name (``layer_output`` is accepted for ``layer-output``)."""
    name = value.replace("_", "-") if isinstance(value, str) else None
    if name not in CONVENTIONS:
        raise QStreamError(
            f"{where}: layer convention {value!r} is not one of {', '.join(CONVENTIONS)}"
        )
    return CONVENTIONS[name]


def parse_ids(value: object, where: str) -> tuple[int, ...]:
    """Layer ids from a list of ints or a comma-separated string."""
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
    """N, the target's layer count: the draft's ``target_num_hidden_layers``, else (a
    speculators-layout draft's config has none) ``num_hidden_layers`` of ``target``'s
    config.json."""
    if config.target_num_hidden_layers is not None or target is None:
        return config.target_num_hidden_layers
    return read_target_shape(target).num_hidden_layers


def check_layer_ids(
    ids: tuple[int, ...], convention: Convention, config: DraftConfig, where: str, n: int | None
):
    """Refuse ids (named by ``where``) that are not the draft's ``target_layer_ids``.  A trailing
    last layer (index N, or output N−1; ``n``: N, from :func:`target_depth`) names the final
    state and is allowed."""
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
        if self.weight is None:
            return x
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def to_json(self) -> dict | None:
        return None if self.weight is None else {"weight": self.source, "eps": self.eps}


def read_final_norm(target: str | None, width: int, why: str) -> FinalNorm:
    """``model.norm.weight`` [width] and ``rms_norm_eps`` of the HF checkpoint ``target``."""
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
