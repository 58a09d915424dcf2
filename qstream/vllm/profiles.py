"""How vLLM 0.32.0 builds the layers of a checkpoint it serves: a *serving profile* per
architecture, as data (docs/vllm.md names the vLLM file and function of every rule): which
checkpoint modules load into which runtime module, which are fused and which are never quantized.
``generic`` is a Hugging Face causal LM (siblings fused through ``packed_modules_mapping``); each
draft architecture with ``serving`` data (docs/model.md; qstream/arch/*/__init__.py) has its own."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from qstream.arch.registry import ARCHITECTURES
from qstream.errors import QStreamError


def matches(pattern: str, module: str) -> bool:
    """Module-name patterns (docs/quantize.md, "Which modules are quantized"): equal, dotted
    suffix, glob, or ``re:`` + Python regex (re.match, as vLLM's ``re:`` ignore entries)."""
    if pattern.startswith("re:"):
        try:
            return re.match(pattern[3:], module) is not None
        except re.error as exc:
            raise QStreamError(
                f"pattern {pattern!r} is not a valid regular expression ({exc})"
            ) from exc
    return (
        module == pattern or module.endswith("." + pattern) or fnmatch.fnmatchcase(module, pattern)
    )


# Projections vLLM fuses into one matrix in Hugging Face models (docs/quantize.md, "Fused
# groups"), by their last name component; members are siblings under one parent.
GENERIC_FUSED = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("w1", "w3"),
)
# Members vLLM cannot build without their siblings, and what is left out on purpose
# (docs/quantize.md, "Tensors checked against the config"): gate_up_proj is a
# MergedColumnParallelLinear, qkv_proj a QKVParallelLinear (LlamaMLP, LlamaAttention in
# vllm/model_executor/models/llama.py).
GENERIC_PARTNERS = {
    "gate_proj": ("up_proj",),
    "k_proj": ("q_proj", "v_proj"),
    "v_proj": ("q_proj", "k_proj"),
}
# Fused groups whose members are the two halves of one gated MLP: vLLM builds them with equal
# output sizes ([intermediate_size] * 2), so their whole shapes agree, not only their K.
GENERIC_EQUAL_SHAPES = (("gate_proj", "up_proj"), ("w1", "w3"))


@dataclass(frozen=True)
class FusedGroup:
    """Checkpoint modules vLLM loads into one quantized layer (the DSpark draft: into two that
    share members): all quantized or none, one NVFP4 global scale."""

    label: str  # how errors name the group
    members: tuple[str, ...]  # checkpoint module names, checkpoint order
    rule: str  # why (the vLLM behaviour; docs/vllm.md cites it)


@dataclass(frozen=True)
class RuntimeModule:
    """One Linear layer as vLLM builds it."""

    name: str  # vLLM's module name, e.g. model.layers.93.self_attn.fused_qkv_a_proj
    shards: tuple[str, ...]  # checkpoint modules loaded into it, in order
    split: str  # what tensor parallelism divides: "out" (column), "in" (row) or "none"
    quant_name: str  # the name vLLM matches against ignore to pick the layer's scheme
    linear: bool = True  # a Linear class ("Linear" targets it); False: a ParallelLMHead


@dataclass(frozen=True)
class Profile:
    """How vLLM serves one architecture (module docstring)."""

    name: str
    architectures: tuple[str, ...]  # config.json "architectures" values it applies to
    served_class: str = ""  # the model class vLLM's registry.py serves the name as
    method: str = "dspark"  # vLLM's SpeculativeConfig.method for the draft
    # the package under vllm/v1/worker/gpu/spec_decode/ whose utils.load_{loader}_model loads
    # it ("": the method's own)
    loader: str = ""
    # whether vLLM takes the drafted count from num_speculative_tokens only (no config default)
    drafted_tokens_given: bool = False
    # checkpoint module kind (under layers.{i}.) -> (runtime module under model.layers.{L+i}.,
    # what tensor parallelism splits); empty: every module is its own runtime module
    layer_modules: Mapping[str, tuple[str, str]] = field(default_factory=dict, compare=False)
    never_quantized: Mapping[str, str] = field(default_factory=dict, compare=False)  # kind: why
    context_proj: str | None = None  # a top-level module loaded under model.
    context_kv: str | None = None  # the runtime module every layer's cross_layer kind joins
    cross_layer: tuple | None = None  # (kinds fused across every layer, label, rule)
    # ParallelLMHeads built with the quant config: kind -> {"runtime", "target", "formats",
    # and "config_flag": the config.json key that must be true for it to be}
    lm_heads: Mapping[str, Mapping] = field(default_factory=dict, compare=False)
    # quantize's default selection: the architecture's quantize_include (else every Linear)
    default_include: tuple[str, ...] = ()
    # attention heads: (query, key/value) config.json keys, when vLLM's QKVParallelLinear
    # splits them at TP (key/value heads replicated when fewer than the TP size)
    gqa_heads: tuple[str, str] | None = None
    speculators_types: tuple[str, ...] = ()  # saved speculators configs vLLM serves as this
    # ... when their transformer_layer_config's model_type is this (None: any)
    speculators_form: str | None = None
    # a draft whose layers vLLM renames and fuses by the profile's tables
    renames_layers = property(lambda self: bool(self.layer_modules))


GENERIC = "generic"
K3_DSPARK = "K3DSparkModel"
# Drafts whose attention vLLM 0.32.0 builds outside its ``Attention`` class, so that
# compressed-tensors' KV-cache method (``CompressedTensorsConfig.get_quant_method``: only an
# ``Attention`` gets one) gives it no k_scale / v_scale parameter (docs/vllm.md, "Activation
# schemes and KV-cache scales"; pinned in tests/test_vllm_schemes.py).
KV_SCALES_NOT_LOADED = {
    K3_DSPARK: "vLLM 0.32.0's K3 DSpark draft builds its MLA attention (kimi_k3/nvidia/mla.py "
    "MultiHeadLatentAttention) with no k_scale/v_scale parameter: it refuses a stored k_scale "
    "(ValueError: no module ...self_attn.attn), its cache stays at --kv-cache-dtype whatever "
    "kv_cache_scheme says, and an fp8 cache is served with scale 1.0 (dspark_mla.py "
    "_context_kv_scales)",
}
PROFILES = {
    GENERIC: Profile(GENERIC, ()),
    **{s["name"]: Profile(**s) for a in ARCHITECTURES for s in a.serving},
}


def profile_for(config: Mapping) -> Profile:
    """The profile of config.json's architecture, or of its ``speculators_model_type`` and form
    (``generic`` otherwise)."""
    names, kind = set(config.get("architectures") or []), config.get("speculators_model_type")
    layer = config.get("transformer_layer_config")
    form = layer.get("model_type", "llama") if isinstance(layer, Mapping) else None
    for p in PROFILES.values():
        if kind:
            if kind in p.speculators_types and p.speculators_form in (None, form):
                return p
        elif names & set(p.architectures):
            return p
    return PROFILES[GENERIC]


_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def split_layer(module: str) -> tuple[int | None, str]:
    """``layers.3.mlp.down_proj`` -> ``(3, "mlp.down_proj")``; a top-level module -> (None, it)."""
    m = _LAYER.match(module)
    return (int(m.group(1)), m.group(2)) if m else (None, module)


def module_kind(module: str) -> str:
    """A module name without its layer: ``layers.3.mlp.down_proj`` -> ``mlp.down_proj``."""
    return split_layer(module)[1]


def never_quantized(profile: Profile, module: str) -> str | None:
    """Why vLLM never builds ``module`` quantized under ``profile`` (None: it may)."""
    return profile.never_quantized.get(module_kind(module))


def head_problem(profile: Profile, module: str, fmt: str, config: Mapping) -> str | None:
    """Why vLLM 0.32.0 cannot serve the ParallelLMHead ``module`` quantized in ``fmt`` (None: it
    can, or ``module`` is not such a head; docs/vllm.md)."""
    head = profile.lm_heads.get(module)
    if head is None:
        return None
    if fmt not in head["formats"]:
        return f"vLLM 0.32.0 loads it quantized only as {', '.join(head['formats'])}"
    flag = head.get("config_flag")
    if flag and config.get(flag) is not True:
        return (
            f"vLLM 0.32.0's {profile.served_class} builds it with the draft's quant config "
            f"only when config.json sets {flag}: true"
        )
    topk = config.get("dspark_draft_topk")
    if topk is not None:
        return (
            f"config.json sets dspark_draft_topk {topk}: vLLM 0.32.0's gathered Markov "
            "projection (DSparkMarkovHead.apply_bias_gathered) needs it unquantized and "
            "raises at the first draft step"
        )
    return None


def head_targets(profile: Profile, quantized: Iterable[str]) -> list[str]:
    """The config group targets that give the quantized ParallelLMHeads their scheme (their
    class name holds no "linear", so the "Linear" target misses them)."""
    return [profile.lm_heads[m]["target"] for m in quantized if m in profile.lm_heads]


def fused_groups(modules: Iterable[str], profile: Profile | None = None) -> list[FusedGroup]:
    """The groups among ``modules`` vLLM quantizes as one under ``profile`` (default: generic)."""
    modules = list(modules)
    if profile is not None and profile.renames_layers:
        return _draft_groups(profile, modules)
    present = set(modules)
    parents = dict.fromkeys(m.rsplit(".", 1)[0] for m in modules if "." in m)
    groups = []
    for parent in parents:
        for leaves in GENERIC_FUSED:
            members = tuple(f"{parent}.{leaf}" for leaf in leaves if f"{parent}.{leaf}" in present)
            if len(members) >= 2:
                label = f"{parent}.{{{', '.join(m.rsplit('.', 1)[-1] for m in members)}}}"
                groups.append(FusedGroup(label, members, "vLLM fuses them into one matrix"))
    return groups


def _draft_groups(profile: Profile, modules: list[str]) -> list[FusedGroup]:
    """The profile's cross-layer group (K3: q_a_proj + kv_a_proj_with_mqa of *every* layer),
    then per layer the kinds loaded into one runtime module (K3: gate_proj + up_proj)."""
    groups = []
    kinds, label, rule = profile.cross_layer or ((), "", "")
    across = tuple(m for m in modules if module_kind(m) in kinds)
    if len(across) >= 2:
        groups.append(FusedGroup(label, across, rule))
    fused: dict[str, list[str]] = {}
    for kind, (leaf, _) in profile.layer_modules.items():
        if kind not in kinds:
            fused.setdefault(leaf, []).append(kind)
    by_layer: dict[tuple[int, str], list[str]] = {}
    for m in modules:
        layer, kind = split_layer(m)
        leaf = profile.layer_modules.get(kind, ("", ""))[0]
        if layer is not None and len(fused.get(leaf, ())) > 1:
            by_layer.setdefault((layer, leaf), []).append(m)
    for (layer, leaf), members in by_layer.items():
        if len(members) == len(fused[leaf]):
            parent = leaf.rsplit(".", 1)[0]
            leaves = ", ".join(k.rsplit(".", 1)[-1] for k in fused[leaf])
            name = leaf.rsplit(".", 1)[-1]
            label = f"layers.{layer}.{parent}.{{{leaves}}}"
            groups.append(FusedGroup(label, tuple(members), f"vLLM fuses them into {name}"))
    return groups


def runtime_modules(
    profile: Profile, modules: Iterable[str], target_layers: int
) -> list[RuntimeModule]:
    """The Linear layers vLLM builds from the weight-holding ``modules``, a draft's layers from
    index L = ``target_layers`` on (``generic``: each module its own, under its own name)."""
    modules = list(modules)
    if not profile.renames_layers:
        return [RuntimeModule(m, (m,), "none", m) for m in modules]
    out: dict[str, list[str]] = {}
    split: dict[str, str] = {}
    for m in modules:
        layer, kind = split_layer(m)
        if layer is not None and kind in profile.layer_modules:
            leaf, how = profile.layer_modules[kind]
            name = f"model.layers.{target_layers + layer}.{leaf}"
        elif m == profile.context_proj:
            name, how = f"model.{m}", "none"
        else:
            continue
        out.setdefault(name, []).append(m)
        split[name] = how
    result = [RuntimeModule(name, tuple(shards), split[name], name) for name, shards in out.items()]
    for m in modules:
        head = profile.lm_heads.get(m)
        if head is not None:
            runtime = head["runtime"]
            result.append(RuntimeModule(runtime, (m,), "none", runtime, linear=False))
    kinds = profile.cross_layer[0] if profile.cross_layer else ()
    kv_a = tuple(m for m in modules if kinds and module_kind(m) == kinds[-1])
    if kv_a and profile.context_kv:
        first = min(layer for layer, _ in map(split_layer, kv_a) if layer is not None)
        quant_name = f"model.layers.{target_layers + first}.self_attn.fused_qkv_a_proj"
        result.append(RuntimeModule(profile.context_kv, kv_a, "none", quant_name))
    return result


def ignore_entries(
    profile: Profile, ignored: Iterable[str], modules: Iterable[str], target_layers: int | None
) -> list[str]:
    """The ``ignore`` list that makes vLLM's matcher leave exactly ``ignored`` unquantized:
    ``generic``, the names themselves; a draft, one ``re:`` entry per kind ignored in every layer
    (matching checkpoint, runtime and fused runtime names whatever L), and for a kind ignored in
    some layers only the checkpoint name and the runtime name at ``target_layers``."""
    ignored = list(ignored)
    if not profile.renames_layers:
        return ignored
    ignored_set = set(ignored)
    by_kind: dict[str, list[str]] = {}
    for m in modules:
        by_kind.setdefault(module_kind(m), []).append(m)
    entries: dict[str, None] = {}  # in order, each once
    for kind, members in by_kind.items():
        inside = [m for m in members if m in ignored_set]
        if len(inside) == len(members):
            entries[_kind_regex(profile, kind, ignored_set, by_kind)] = None
            continue
        for m in inside:
            entries[m] = None
            layer, _ = split_layer(m)
            if layer is not None and kind in profile.layer_modules and target_layers is not None:
                runtime = f"model.layers.{target_layers + layer}.{profile.layer_modules[kind][0]}"
                entries[runtime] = None
    return list(entries)


def target_layers_of(config: Mapping) -> int | None:
    """L, the target's layer count, from a draft's config.json (vLLM takes it from the target's)."""
    value = config.get("target_num_hidden_layers")
    return value if isinstance(value, int) and value >= 0 else None


def layer_specific_warning(
    profile: Profile, entries: Iterable[str], target_layers: int | None
) -> str | None:
    """A warning when a draft's ``entries`` name single runtime layers: they hold for one L."""
    exact = [e for e in entries if e.startswith("model.layers.")]
    if not profile.renames_layers or not exact:
        return None
    return (
        f"{len(exact)} ignore entries name single runtime layers ({exact[0]}, ...) at "
        f"L={target_layers} (config.json's target_num_hidden_layers); served beside a "
        "target with another layer count, vLLM quantizes those layers. Ignore whole module "
        "kinds to be independent of L"
    )


def _kind_regex(
    profile: Profile, kind: str, ignored: set[str], by_kind: Mapping[str, list[str]]
) -> str:
    """``re:(.*\\.)?<kind>$``; a fused kind also names its fused runtime leaf (and, when its
    partner kind is ignored everywhere too, the partner: one entry for the pair)."""
    if kind not in profile.layer_modules:
        return f"re:(.*\\.)?{re.escape(kind)}$"
    fused = profile.layer_modules[kind][0]
    partners = [k for k, (leaf, _) in profile.layer_modules.items() if leaf == fused]
    if len(partners) == 1:
        return f"re:.*\\.{re.escape(kind)}$"
    whole = [k for k in partners if k in by_kind and all(m in ignored for m in by_kind[k])]
    parent = kind.rsplit(".", 1)[0]
    if fused.rsplit(".", 1)[0] != parent:  # EAGLE-3's Qwen3 form: qkv_proj under the layer
        return f"re:.*\\.({'|'.join(re.escape(k) for k in [*whole, fused])})$"
    leaves = [k.rsplit(".", 1)[1] for k in whole] + [fused.rsplit(".", 1)[1]]
    return f"re:.*\\.{re.escape(parent)}\\.({'|'.join(leaves)})$"


# Tensor parallelism (docs/vllm.md, "The rules"); the generic profile knows no model's splits.


def tp_build_problem(
    profile: Profile, config: Mapping, shapes: Mapping[str, tuple[int, ...]], tp: int
) -> str | None:
    """Why vLLM 0.32.0 cannot build the draft at tensor-parallel size ``tp`` (None: it can):
    heads or a split size ``tp`` does not divide.  ``shapes``: module -> [N, K]."""
    if not profile.renames_layers or tp <= 1:
        return None
    reasons = []
    heads = config.get("num_attention_heads")
    if isinstance(heads, int) and heads % tp:
        reasons.append(f"num_attention_heads {heads} is not a multiple of {tp}")
    # QKVParallelLinear (vllm/model_executor/layers/linear.py) and DFlashQwen3Attention.__init__
    # assert that the key/value heads divide by the TP size or, when fewer, divide it
    if profile.gqa_heads:
        key = profile.gqa_heads[1]
        kv = config.get(key)
        if isinstance(kv, int) and kv >= 1 and (kv % tp if kv >= tp else tp % kv):
            reasons.append(f"{key} {kv} neither divides by nor divides {tp}")
    shapes = {m: s for m, s in shapes.items() if len(s) == 2}
    leaves: set[str] = set()
    qkv = profile.layer_modules.get("self_attn.q_proj", ("",))[0]
    for rt in runtime_modules(profile, shapes, target_layers=0):
        leaf = rt.name.split(".", 3)[-1]
        if profile.gqa_heads and leaf == qkv:
            continue  # split by heads, checked above (key/value heads may be replicated)
        sizes = [shapes[m][0] for m in rt.shards] if rt.split == "out" else []
        sizes += [shapes[rt.shards[0]][1]] if rt.split == "in" else []
        uneven = next((size for size in sizes if size % tp), None)
        if uneven is not None and leaf not in leaves:
            leaves.add(leaf)
            what = "an output" if rt.split == "out" else "the input"
            reasons.append(f"{leaf} has {what} size {uneven}, not a multiple of {tp}")
    return "; ".join(reasons) or None


def tp_scale_problem(profile: Profile, module: str, k: int, block: int, tp: int) -> str | None:
    """Why vLLM 0.32.0 gives ``module`` (K inputs in blocks of ``block``) the wrong block scales
    at size ``tp``: a row-parallel shard that is not whole blocks reads other inputs' scales
    (RowvLLMParameter.load_row_parallel_weight, docs/vllm.md)."""
    layer, kind = split_layer(module)
    split = profile.layer_modules.get(kind, ("", "none"))[1] if layer is not None else "none"
    if not block or tp <= 1 or k % tp or split != "in" or k // tp % block == 0:
        return None
    return (
        f"K per shard {k // tp} at tensor_parallel_size {tp} is not a multiple of the block size "
        f"{block}: vLLM 0.32.0 would give each shard the wrong block scales"
    )
