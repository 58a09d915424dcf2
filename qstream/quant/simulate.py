"""A format simulated in memory: the selected Linear weights quantized and dequantized, as
loading what ``qstream quantize`` writes would give them (docs/eval-drift.md, "Variants")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from qstream.arch.interface import LM_HEAD, DraftConfig
from qstream.checkpoint.safetensors_io import DTYPE_NAMES, TensorInfo, drop_resident_pages
from qstream.formats import dequantize, get_format, quantize
from qstream.formats.nvfp4 import tensor_amax
from qstream.quant.select import Selection, select_modules, share_group_amax
from qstream.vllm.profiles import profile_for


def simulate_format(
    weights: Mapping[str, torch.Tensor],
    fmt: str,
    include: Iterable[str] | None,
    ignore: Iterable[str] | None = None,
    skip_incompatible: bool = False,
    *,
    config: DraftConfig,
) -> dict[str, torch.Tensor]:
    """``weights`` with the selected Linear weights quantized to ``fmt`` and dequantized (never
    lm_head, the target's)."""
    draft = {k: v for k, v in weights.items() if k != LM_HEAD}
    selection = simulated_selection(weights, fmt, include, ignore, skip_incompatible, config)
    amax: dict[str, torch.Tensor] = {}
    if get_format(fmt).global_scale:
        amax = share_group_amax(
            {m: tensor_amax(draft[f"{m}.weight"]) for m in selection.quantized},
            selection.fused_groups,
        )
    out = dict(weights)
    for module in selection.quantized:
        w = draft[f"{module}.weight"]
        stored = quantize(fmt, w, name=f"{module}.weight", global_amax=amax.get(module))
        out[f"{module}.weight"] = dequantize(fmt, stored, dtype=w.dtype)
        drop_resident_pages(w)  # a mapped original: its pages leave this process's memory
    return out


def simulated_selection(
    weights: Mapping[str, torch.Tensor],
    fmt: str,
    include: Iterable[str] | None,
    ignore: Iterable[str] | None,
    skip_incompatible: bool,
    config: DraftConfig,
) -> Selection:
    draft = {k: v for k, v in weights.items() if k != LM_HEAD}
    infos = {k: TensorInfo(k, DTYPE_NAMES[v.dtype], tuple(v.shape), 0, 0) for k, v in draft.items()}
    profile = profile_for(config.to_json())
    return select_modules(
        infos,
        fmt,
        list(include or profile.default_include),
        list(ignore or []),
        skip_incompatible=skip_incompatible,
        profile=profile,
    )
