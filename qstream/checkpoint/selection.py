"""Which modules get quantized: the pattern rules of DESIGN.md section 2, the default selection,
fused groups (section 4) and the block-size shape rule.

A module is a tensor name without its ``.weight``; the checkpoint's weight-holding modules are
the names of its ``*.weight`` tensors.  Everything here works on names, shapes and dtypes only.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from qstream.checkpoint.safetensors_io import TensorInfo
from qstream.errors import QStreamError
from qstream.formats import get_format

FLOAT_DTYPES = ("BF16", "F16", "F32")

# Projections vLLM fuses into one matrix (DESIGN.md section 4), by their last name component;
# members are siblings under one parent (per-expert gate/up included: experts.<e>.gate_proj).
FUSED_MEMBERS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("w1", "w3"),
)

# Left out of the default selection (an explicit --include_layers can still name them):
# embedding tables, which are not Linear layers (DSpark's markov_w1 is one, DESIGN.md
# section 5); output heads; and MoE routers, which vLLM builds unquantized.
EMBEDDING_NAMES = ("wte", "wpe", "markov_w1")
HEAD_NAMES = ("lm_head",)
ROUTER_NAMES = ("gate", "router")


@dataclass(frozen=True)
class FusedGroup:
    parent: str
    members: tuple[str, ...]  # full module names

    @property
    def label(self) -> str:
        return f"{self.parent}.{{{', '.join(m.rsplit('.', 1)[-1] for m in self.members)}}}"


@dataclass(frozen=True)
class Selection:
    quantized: tuple[str, ...]  # modules to quantize, in checkpoint order
    ignored: tuple[str, ...]  # every other weight-holding module, in checkpoint order
    skipped: dict[str, str]  # selected but left unquantized (--skip-incompatible): reason
    fused_groups: tuple[FusedGroup, ...]  # groups whose members are quantized


def matches(pattern: str, module: str) -> bool:
    """DESIGN.md section 2: equal, dotted suffix, glob, or ``re:`` + Python regex (re.match)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return (module == pattern or module.endswith("." + pattern)
            or fnmatch.fnmatchcase(module, pattern))


def _leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def is_embedding(module: str) -> bool:
    return "embed" in _leaf(module) or _leaf(module) in EMBEDDING_NAMES


def quantizable(info: TensorInfo) -> bool:
    """A float 2-D weight, i.e. what a Linear layer holds."""
    return len(info.shape) == 2 and info.dtype in FLOAT_DTYPES


def weight_modules(tensors: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    """``{module: info of module.weight}`` in checkpoint order."""
    return {n[: -len(".weight")]: i for n, i in tensors.items() if n.endswith(".weight")}


def fused_groups(modules: Iterable[str]) -> list[FusedGroup]:
    modules = list(modules)
    present = set(modules)
    parents = dict.fromkeys(m.rsplit(".", 1)[0] for m in modules if "." in m)
    groups = []
    for parent in parents:
        for leaves in FUSED_MEMBERS:
            members = tuple(f"{parent}.{leaf}" for leaf in leaves if f"{parent}.{leaf}" in present)
            if len(members) >= 2:
                groups.append(FusedGroup(parent, members))
    return groups


def _default_selection(modules: Mapping[str, TensorInfo]) -> set[str]:
    return {m for m, info in modules.items() if quantizable(info) and not is_embedding(m)
            and _leaf(m) not in HEAD_NAMES + ROUTER_NAMES}


def _included(modules: Mapping[str, TensorInfo], patterns: list[str]) -> set[str]:
    selected: set[str] = set()
    for pattern in patterns:
        hit = [m for m in modules if matches(pattern, m)]
        if not hit:
            raise QStreamError(f"--include_layers pattern {pattern!r} matches no module")
        usable = [m for m in hit if quantizable(modules[m]) and not is_embedding(m)]
        if not usable:
            m = hit[0]
            why = "an embedding" if is_embedding(m) else \
                f"{modules[m].dtype} {list(modules[m].shape)}, not a 2-D float weight"
            raise QStreamError(f"--include_layers pattern {pattern!r} matches only modules that "
                               f"cannot be quantized, e.g. {m} ({why})")
        selected.update(usable)
    return selected


def _ignored(modules: Mapping[str, TensorInfo], patterns: list[str]) -> set[str]:
    ignored: set[str] = set()
    for pattern in patterns:
        hit = {m for m in modules if matches(pattern, m)}
        if not hit:
            raise QStreamError(f"--ignore_layers pattern {pattern!r} matches no module")
        ignored |= hit
    return ignored


def _apply_shape_rule(modules, selected: set[str], block: int, skip: bool) -> dict[str, str]:
    """DESIGN.md section 3: K must be a multiple of the format's block size."""
    skipped = {}
    for m in [m for m in modules if m in selected]:
        k = modules[m].shape[1]
        if block and k % block:
            reason = f"K={k} is not a multiple of the block size {block}"
            if not skip:
                raise QStreamError(f"{m}.weight: shape {list(modules[m].shape)}: {reason} "
                                   "(use --skip-incompatible to leave it unquantized)")
            skipped[m] = reason
            selected.discard(m)
    return skipped


def _check_fused(groups, selected: set[str], skipped: dict[str, str]) -> None:
    """All members of a fused group quantized, or none (DESIGN.md section 4).  A group that is
    split only because --skip-incompatible dropped a member is dropped whole."""
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
        names = lambda ms: ", ".join(_leaf(m) for m in ms)  # noqa: E731
        raise QStreamError(f"fused group {group.label} would be split: quantized "
                           f"{names(inside)}; not quantized {names(outside)} "
                           "(vLLM needs all or none)")


def select_modules(
    tensors: Mapping[str, TensorInfo], fmt: str, include: Iterable[str] | None = None,
    ignore: Iterable[str] | None = None, skip_incompatible: bool = False,
) -> Selection:
    """Apply DESIGN.md section 2's rules: ``include`` (default: every 2-D float Linear weight
    except embeddings, lm_head and MoE routers), minus ``ignore`` (which wins), then the shape
    rule and the fused-group rule.  A pattern that matches nothing is an error."""
    modules = weight_modules(tensors)
    include, ignore = list(include or []), list(ignore or [])
    selected = _included(modules, include) if include else _default_selection(modules)
    selected -= _ignored(modules, ignore)
    skipped = _apply_shape_rule(modules, selected, get_format(fmt).block_size, skip_incompatible)
    groups = fused_groups(modules)
    _check_fused(groups, selected, skipped)
    if not selected:
        raise QStreamError("the selection quantizes no module")
    return Selection(
        quantized=tuple(m for m in modules if m in selected),
        ignored=tuple(m for m in modules if m not in selected),
        skipped={m: skipped[m] for m in modules if m in skipped},
        fused_groups=tuple(g for g in groups if g.members[0] in selected),
    )
