"""Which modules get quantized (docs/quantize.md; the serving profile's rules: docs/vllm.md), on
names, shapes and dtypes only.  A module is a ``*.weight`` tensor's name without ``.weight``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from qstream.checkpoint.safetensors_io import TensorInfo
from qstream.errors import QStreamError
from qstream.formats import get_format
from qstream.units import FLOAT_DTYPE_NAMES
from qstream.vllm import profiles as serving
from qstream.vllm.profiles import GENERIC, PROFILES, FusedGroup, Profile, matches

T = TypeVar("T")

# Left out of the default selection (an explicit --include_layers can still name them):
# embedding tables, which are not Linear layers (DSpark's markov_w1 is one, docs/quantize.md
# section 5); output heads; and MoE routers, which most vLLM 0.32.0 MoE models build as a
# GateLinear without a quant config (e.g. MixtralMoE.__init__ in
# vllm/model_executor/models/mixtral.py; Qwen3MoeSparseMoeBlock passes one).
EMBEDDING_NAMES = ("wte", "wpe", "markov_w1")
HEAD_NAMES = ("lm_head",)
ROUTER_NAMES = ("gate", "router")


@dataclass(frozen=True)
class Selection:
    quantized: tuple[str, ...]  # modules to quantize, in checkpoint order
    ignored: tuple[str, ...]  # every other weight-holding module, in checkpoint order
    skipped: dict[str, str]  # selected but left unquantized (--skip-incompatible): reason
    fused_groups: tuple[FusedGroup, ...]  # groups whose members are quantized
    profile: Profile = PROFILES[GENERIC]  # the serving rules the selection follows


def _leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def is_embedding(module: str) -> bool:
    return "embed" in _leaf(module) or _leaf(module) in EMBEDDING_NAMES


def quantizable(info: TensorInfo) -> bool:
    return len(info.shape) == 2 and info.dtype in FLOAT_DTYPE_NAMES


def weight_modules(tensors: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    return {n[: -len(".weight")]: i for n, i in tensors.items() if n.endswith(".weight")}


def _included(
    modules: Mapping[str, TensorInfo],
    patterns: list[str],
    profile: Profile,
    dropped: dict[str, str],
) -> set[str]:
    """The modules ``patterns`` select; one vLLM cannot serve quantized goes to ``dropped``."""
    selected: set[str] = set()
    for pattern in patterns:
        hit = [m for m in modules if matches(pattern, m)]
        if not hit:
            raise QStreamError(f"--include_layers pattern {pattern!r} matches no module")
        refused = {m: serving.never_quantized(profile, m) for m in hit if quantizable(modules[m])}
        refused = {m: why for m, why in refused.items() if why is not None}
        if refused and len(refused) == len(hit):
            m, why = next(iter(refused.items()))
            raise QStreamError(
                f"--include_layers pattern {pattern!r} selects {m}, which vLLM "
                f"cannot serve quantized: {why} (docs/vllm.md)"
            )
        usable = [
            m for m in hit if quantizable(modules[m]) and not is_embedding(m) and m not in refused
        ]
        for m, why in refused.items():
            if not is_embedding(m):
                dropped[m] = f"vLLM cannot serve it quantized: {why}"
        if not usable:
            m = hit[0]
            why = (
                "an embedding"
                if is_embedding(m)
                else f"{modules[m].dtype} {list(modules[m].shape)}, not a 2-D float weight"
            )
            raise QStreamError(
                f"--include_layers pattern {pattern!r} matches only modules that "
                f"cannot be quantized, e.g. {m} ({why})"
            )
        selected.update(usable)
    return selected


def _apply_shape_rule(
    modules, selected: set[str], block: int, skip: bool, profile: Profile, tp: int
) -> dict[str, str]:
    """docs/formats.md: K, and each shard's K where vLLM splits it at tensor-parallel size
    ``tp`` (docs/vllm.md), must be a multiple of the block size."""
    skipped = {}
    for m in [m for m in modules if m in selected]:
        k = modules[m].shape[1]
        reason = (
            f"K={k} is not a multiple of the block size {block}"
            if block and k % block
            else serving.tp_scale_problem(profile, m, k, block, tp)
        )
        if reason:
            if not skip:
                raise QStreamError(
                    f"{m}.weight: shape {list(modules[m].shape)}: {reason} "
                    "(use --skip-incompatible to leave it unquantized)"
                )
            skipped[m] = reason
            selected.discard(m)
    return skipped


def _check_fused(groups, selected: set[str], skipped: dict[str, str]) -> None:
    """All members of a fused group quantized, or none (docs/vllm.md)."""
    for group in groups:
        inside = [m for m in group.members if m in selected]
        outside = [m for m in group.members if m not in selected]
        if not inside or not outside:
            continue
        if all(m in skipped for m in outside):
            for m in inside:
                selected.discard(m)
                skipped[m] = f"fused with {', '.join(outside)}, which cannot be quantized"
            continue
        raise QStreamError(
            f"fused group {group.label} would be split: quantized "
            f"{_names(inside)}; not quantized {_names(outside)} "
            f"(all or none: {group.rule})"
        )


def _names(modules: list[str], limit: int = 4) -> str:
    if len({m.rsplit(".", 1)[0] for m in modules}) == 1:
        modules = [_leaf(m) for m in modules]
    shown = ", ".join(modules[:limit])
    return shown + (f" and {len(modules) - limit} more" if len(modules) > limit else "")


def select_modules(
    tensors: Mapping[str, TensorInfo],
    fmt: str,
    include: Iterable[str] | None = None,
    ignore: Iterable[str] | None = None,
    skip_incompatible: bool = False,
    profile: Profile | None = None,
    tensor_parallel_size: int = 1,
) -> Selection:
    """The selection rules (docs/quantize.md): ``include`` (default: every 2-D float Linear
    weight but embeddings, heads, routers and what vLLM never quantizes), minus ``ignore``."""
    profile = profile or PROFILES[GENERIC]
    modules = weight_modules(tensors)
    include, ignore = list(include or []), list(ignore or [])
    dropped: dict[str, str] = {}
    if include:
        selected = _included(modules, include, profile, dropped)
    else:
        selected = {
            m
            for m, info in modules.items()
            if quantizable(info)
            and not is_embedding(m)
            and _leaf(m) not in HEAD_NAMES + ROUTER_NAMES
            and serving.never_quantized(profile, m) is None
        }
    for pattern in ignore:
        hit = {m for m in modules if matches(pattern, m)}
        if not hit:
            raise QStreamError(f"--ignore_layers pattern {pattern!r} matches no module")
        selected -= hit
    skipped = _apply_shape_rule(
        modules, selected, get_format(fmt).block_size, skip_incompatible, profile,
        tensor_parallel_size,
    )  # fmt: skip
    skipped.update({m: why for m, why in dropped.items() if m not in skipped})
    groups = serving.fused_groups(modules, profile)
    _check_fused(groups, selected, skipped)
    if not selected:
        raise QStreamError("the selection quantizes no module")
    return Selection(
        quantized=tuple(m for m in modules if m in selected),
        ignored=tuple(m for m in modules if m not in selected),
        skipped={m: skipped[m] for m in modules if m in skipped},
        fused_groups=tuple(g for g in groups if g.members[0] in selected),
        profile=profile,
    )


def share_group_amax(amax: Mapping[str, T], groups: Iterable[FusedGroup]) -> dict[str, T]:
    """``amax`` with each fused group's members given the group's maximum (docs/vllm.md)."""
    shared = dict(amax)
    for group in groups:
        top = max((amax[m] for m in group.members), key=lambda value: float(value))  # type: ignore[arg-type]
        shared.update(dict.fromkeys(group.members, top))
    return shared
