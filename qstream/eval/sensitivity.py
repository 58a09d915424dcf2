"""Per-module sensitivity (docs/sensitivity.md): which module kinds cost acceptance under a
format, and the largest include list that keeps the greedy acceptance ceiling within a tolerance
of bf16.  Each kind (fused partners one kind) is quantized alone, then the kinds are added least
harmful first; every step is a variant measured against the regime's one reference pass."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch

from qstream.arch.interface import LM_HEAD, DraftConfig
from qstream.checkpoint.safetensors_io import DTYPE_NAMES, TensorInfo
from qstream.errors import QStreamError
from qstream.eval.settings import DriftSettings
from qstream.formats import FORMATS, get_format
from qstream.quant.select import select_modules
from qstream.serving import FLOOR, Variant
from qstream.vllm.profiles import head_problem, matches, profile_for

DEFAULT_FORMAT = "nvfp4"  # the format the published recipe ships at 4 bits
HARM = (
    "greedy acceptance ceiling drop below the bf16 floor (tokens); ties broken by the larger "
    "KL(ref‖var) mean"
)

# step(name, include patterns) -> the variant's results entry (kind, quantized_tensors,
# weight_snr, metrics); an empty include is the bf16 floor (nothing quantized).
Step = Callable[[str, tuple[str, ...]], dict]


@dataclass(frozen=True)
class ModuleKind:
    """Modules that differ only by layer index, fused partners merged into one kind."""

    name: str  # e.g. "mlp.gate_proj + mlp.up_proj"
    patterns: tuple[str, ...]  # --include_layers patterns selecting exactly ``modules``
    modules: tuple[str, ...]  # full module names, checkpoint order


def sensitivity_variant(settings: DriftSettings) -> Variant:
    """The configuration the steps probe: ``settings.sensitivity_format`` (a token such as
    ``nvfp4+a=nvfp4``, checked by DriftSettings); else nvfp4 when ``formats`` asks for it or for
    no 4-bit format; else the first 4-bit format asked for (``--formats bf16,mxfp4`` -> mxfp4).
    ``--kv-cache-dtype`` serves it, as every variant but the reference."""
    four_bit = [
        f for f in settings.formats if f in FORMATS and get_format(f).weights_args["num_bits"] == 4
    ]
    fmt = four_bit[0] if four_bit and DEFAULT_FORMAT not in four_bit else DEFAULT_FORMAT
    return Variant.parse(settings.sensitivity_format or fmt, settings.kv_cache_dtype)


def step_variant(probed: Variant, name: str, include: tuple[str, ...]) -> Variant:
    """``probed`` on ``include``'s modules alone, activations too (as a checkpoint quantizing only
    those is served); no include: the floor, bf16 weights with ``probed``'s KV cache and target."""
    if include:
        return replace(probed, name=name, include=include)
    return replace(probed, name=name, kind=FLOOR, source=FLOOR, activations="none")


def _kind_key(module: str) -> str:
    """layers.3.mlp.down_proj -> mlp.down_proj."""
    parts = module.split(".")
    digits = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[digits[-1] + 1 :]) if digits else module


def module_kinds(
    weights: Mapping[str, torch.Tensor], fmt: str, config: DraftConfig, ignore: tuple[str, ...] = ()
) -> list[ModuleKind]:
    """Every kind quantize's default selection under the draft's serving profile (docs/vllm.md)
    picks for ``fmt``, minus ``ignore`` and the shapes it cannot hold; fused groups whole, in
    checkpoint order."""
    infos = {
        k: TensorInfo(k, DTYPE_NAMES[v.dtype], tuple(v.shape), 0, 0)
        for k, v in weights.items()
        if k != LM_HEAD
    }
    profile = profile_for(config.to_json())
    # the heads vLLM serves quantized in this format (Qwen3-style DSpark: markov_w2) join the
    # default selection
    heads = [
        m
        for m in profile.lm_heads
        if f"{m}.weight" in infos and head_problem(profile, m, fmt, config.to_json()) is None
    ]
    include = [*profile.default_include, *heads] if profile.default_include else None
    selection = select_modules(
        infos, fmt, include, list(ignore), skip_incompatible=True, profile=profile
    )
    by_key: dict[str, list[str]] = {}
    for module in selection.quantized:
        by_key.setdefault(_kind_key(module), []).append(module)
    merged: dict[str, tuple[str, ...]] = {key: (key,) for key in by_key}  # kind of each key
    for group in selection.fused_groups:
        keys = tuple(dict.fromkeys(k for m in group.members for k in merged[_kind_key(m)]))
        for key in keys:
            merged[key] = keys
    kinds = []
    for keys in dict.fromkeys(merged.values()):
        modules = tuple(m for m in selection.quantized if _kind_key(m) in keys)
        hit = tuple(m for m in selection.quantized if any(matches(k, m) for k in keys))
        if hit != modules:  # a suffix pattern would reach another kind's modules
            raise QStreamError(
                f"module kind {' + '.join(keys)}: the pattern also matches "
                f"{', '.join(sorted(set(hit) - set(modules)))}"
            )
        kinds.append(ModuleKind(" + ".join(keys), keys, modules))
    return kinds


def _summary(result: dict) -> dict:
    m = result["metrics"]
    return {
        "quantized_tensors": result["quantized_tensors"],
        "weight_snr_db": result["weight_snr"]["overall_db"],
        "ceiling": m["rollouts"]["greedy"]["ceiling"],
        "matched_prefix_sampled": m["rollouts"]["sampled"]["matched_prefix"],
        "kl_mean": m["kl"]["mean"]["value"],
        "kl_p99": m["kl"]["p99"],
    }


def _gap(step: dict, floor: dict) -> float:
    """Greedy ceiling of the step minus the floor's (tokens; negative: acceptance lost)."""
    return step["ceiling"]["value"] - floor["ceiling"]["value"]


def _harm(step: dict, floor: dict) -> tuple[float, float]:
    return -_gap(step, floor), step["kl_mean"] or 0.0


def evaluate_sensitivity(
    weights: Mapping[str, torch.Tensor],
    probed: Variant,
    config: DraftConfig,
    settings: DriftSettings,
    step: Step,
    regime: str,
) -> dict:
    """The floor, one step per kind alone, the cumulative steps and the suggested list (JSON-ready;
    schema in docs/eval-drift.md) of ``probed`` (:func:`sensitivity_variant`), run on ``regime``
    (as quantize's ``--calibration`` names it)."""
    kinds = module_kinds(weights, probed.source, config, settings.ignore_layers)
    if not kinds:
        raise QStreamError(f"--sensitivity: {probed.source} can quantize no module of the draft")
    floor = _summary(step("bf16 floor", ()))
    single = [
        {
            "kind": k.name,
            "include": list(k.patterns),
            "modules": list(k.modules),
            **_summary(step(f"{probed.name}: {k.name}", k.patterns)),
        }
        for k in kinds
    ]
    for entry in single:
        entry["ceiling_gap"] = _gap(entry, floor)
    order = sorted(range(len(kinds)), key=lambda i: (*_harm(single[i], floor), i))
    cumulative: list[dict] = []
    include: tuple[str, ...] = ()
    for i in order:
        include += kinds[i].patterns
        entry = {
            "add": kinds[i].name,
            "include": list(include),
            **_summary(step(f"{probed.name}: +{kinds[i].name}", include)),
        }
        entry["ceiling_gap"] = _gap(entry, floor)
        entry["within_tolerance"] = entry["ceiling_gap"] >= -settings.tolerance
        cumulative.append(entry)
    return {
        "format": probed.source,
        **probed.served(),  # its configuration, when not the default
        "tolerance": settings.tolerance,
        "harm": HARM,
        "ignore": list(settings.ignore_layers),
        "floor": floor,
        "single": single,
        "cumulative": cumulative,
        "suggested": _suggest(cumulative, settings, probed, regime),
    }


def _serving_options(probed: Variant, regime: str, seed: int) -> str:
    """quantize's options that write what ``probed`` serves beyond its weights: its activation
    scheme and, for static scales, ``--calibration`` on this regime at this seed
    (docs/quantize.md, "Calibration"); a calibrated KV scale as ``--kv-cache-scheme fp8``."""
    options = []
    if probed.activations != "none":
        options.append(f"--activations {probed.activations}")
    if probed.kv_scale == "calibrated":
        options.append("--kv-cache-scheme fp8")
    if probed.calibrated:
        options.append(f"--calibration {regime}" + (f" --seed {seed}" if seed else ""))
    return "".join(" " + o for o in options)


def _suggest(cumulative: list[dict], settings: DriftSettings, probed: Variant, regime: str) -> dict:
    """The largest cumulative include list within tolerance (steps nest, so the last such one),
    with the quantize options of the probed configuration."""
    within = [e for e in cumulative if e["within_tolerance"]]
    if not within:
        return {"include": [], "steps": 0, "command": None, "ceiling": None, "ceiling_gap": None}
    best = within[-1]
    command = "--include_layers " + " ".join(best["include"])
    if settings.ignore_layers:
        command += " --ignore_layers " + " ".join(settings.ignore_layers)
    command += _serving_options(probed, regime, settings.seed)
    return {
        "include": best["include"],
        "steps": cumulative.index(best) + 1,
        "command": command,
        "ceiling": best["ceiling"],
        "ceiling_gap": best["ceiling_gap"],
    }
