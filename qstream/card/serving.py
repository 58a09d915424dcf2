"""The card's serving conditions (docs/card.md, "Serving conditions"): each variant served
otherwise than ``qstream.serving.DEFAULTS``, what differs, the vLLM 0.32.0 setting that avoids it,
and per regime what it costs against bf16 and against the same weights served at the default.
Results without ``configuration`` (older files) are served at the default: no section."""

from __future__ import annotations

from qstream.card.document import Section
from qstream.card.results import ResultsSet
from qstream.card.tables import (
    DIGITS,
    _emitted_and_loss,
    _gap,
    _prefix,
    difference,
    estimate,
    metrics,
    regime_order,
    variant_order,
)
from qstream.errors import QStreamError
from qstream.eval.vocabulary import FLOOR, VERIFIERS
from qstream.serving import DEFAULTS, Variant
from qstream.tablefit import Cell, Table
from qstream.verification import VLLM_DEFAULT_MODE

# compressed-tensors' input_activations strategy, after "static" or "dynamic" (DESIGN section 8;
# an NVFP4 input's global scale is calibrated, its per-16 block scales come from the input).
STRATEGIES = {
    "token": "per token",
    "tensor": "per tensor",
    "tensor_group": "per tensor, with dynamic per-16 block scales",
}
# The scheme vLLM 0.32.0 builds for the same weights without input_activations, by the scheme
# that quantizes them (compressed_tensors.py, ``_get_scheme_from_parts``: FP8 weights alone are
# CompressedTensorsW8A16Fp8, NVFP4 weights alone CompressedTensorsW4A4Fp4(use_a16=True)).
WEIGHT_ONLY = {"CompressedTensorsW8A8Fp8": "W8A16", "CompressedTensorsW4A4Fp4": "W4A16"}
# vllm/config/speculative.py, ``SpeculativeConfig.kv_cache_dtype``: unset, the draft inherits the
# target's --kv-cache-dtype; set, ``apply_draft_overrides`` gives the draft its own, and "auto"
# is the draft's model dtype (vllm/config/cache.py, ``CacheConfig.cache_dtype``).  The JSON of
# --speculative-config is EngineArgs.speculative_config (vllm/engine/arg_utils.py).
KV_SETTING = '"kv_cache_dtype": "auto" in --speculative-config'
TARGET_SETTING = "none on the draft side: the target is served at its own precision"
# vLLM 0.33.0's speculative_config.draft_lm_head_quantization (vllm/config/speculative.py):
# unset (None), the draft shares the target's head as stored.
HEAD_SETTING = '"draft_lm_head_quantization" unset (vLLM 0.33.0)'
SAME = "same weights at default"
AVOIDED = "avoided in vLLM 0.32.0 by"
UNPAIRED = "unpaired"
CAPTION = (
    "what each serving condition costs. Drift: "
    "the greedy ceiling's gap to bf16, as the ceiling table's. Acceptance: the results' paired "
    "per-block loss against bf16 in tokens per step, {mode}, verified by {verifier} at {temps}. "
    "Against the same weights served at the default: the ceiling gap, and the loss: the paired "
    "one where those weights are bf16's, else the difference of the two tokens per step, "
    "{unpaired} (the results carry no paired difference, so no interval)"
)


def condition_words(variant: Variant) -> tuple[str, str]:
    """What ``variant`` serves otherwise than the default, and the vLLM settings that avoid it:
    ``("KV cache fp8_e4m3, scale 1.0", '"kv_cache_dtype": "auto" in --speculative-config')``."""
    said, avoided = [], []
    act = variant.activation
    if variant.activations != DEFAULTS["activations"]:
        # the scheme quantizes a linear's input to its weights' format (W8A8 FP8, W4A4 NVFP4)
        how = "dynamic" if act.dynamic else "static"
        said.append(f"activations {act.weights[0].upper()} {how} {STRATEGIES[act.strategy]}")
        avoided.append(f"a weight-only checkpoint (vLLM's {WEIGHT_ONLY[act.vllm_scheme]} scheme)")
    if variant.kv_cache != DEFAULTS["kv_cache"]:
        scale = f", scale {variant.kv_scale}" if variant.kv.quantized else ""
        said.append(f"KV cache {variant.kv_cache}{scale}")
        avoided.append(KV_SETTING)
    if variant.target != DEFAULTS["target"]:
        said.append(f"target weights {variant.target}")
        avoided.append(TARGET_SETTING)
    if variant.head != DEFAULTS["head"]:
        said.append(f"drafting head {variant.head}")
        avoided.append(HEAD_SETTING)
    return "; ".join(said), "; ".join(avoided)


def served(name: str, info: dict, where: str) -> Variant:
    """The configuration a results' variant entry records (the default where it records none);
    an unknown value is a QStreamError naming ``where`` it was read, the variant and the value."""
    recorded = info.get("configuration", DEFAULTS)
    try:
        return Variant(name, info["kind"], info["source"], **{**DEFAULTS, **recorded})
    except QStreamError as exc:
        raise QStreamError(f"{where}: {exc}") from exc


def _described(v: Variant, default: str | None) -> list[Cell]:
    """The condition's name, what differs, its weights, its default's name and what avoids it."""
    words, avoided = condition_words(v)
    weights = v.source if v.kind == v.source else f"{v.source} ({v.kind})"
    return [Cell(v.name), Cell(words), Cell(weights), Cell(default or "not in the run"),
            Cell(avoided)]  # fmt: skip


def _conditions(variants: dict[str, Variant]) -> list[tuple[Variant, str | None]]:
    """Each variant off the default, with the first of the same weights at the default (or None)."""
    at_default = [v for v in variants.values() if v.configuration() == DEFAULTS]
    return [
        (v, next((d.name for d in at_default if (d.kind, d.source) == (v.kind, v.source)), None))
        for v in variants.values()
        if v.configuration() != DEFAULTS
    ]


def _loss_vs_default(default: str | None, paired: Cell, values: tuple) -> Cell:
    """Against the same weights at the default: the ``paired`` loss against bf16 where those
    weights are the floor itself, else the difference of the two ``values`` (default's,
    condition's), without an interval, labelled so."""
    if default == FLOOR:
        return paired
    if None in values:
        return Cell("n/a")
    default_value, condition_value = values
    loss = default_value["value"] - condition_value["value"]
    return Cell(f"{difference(loss).text} ({UNPAIRED})", loss)


def costs_table(rs: ResultsSet, regime: str, conditions: list) -> Table:
    """One regime's costs of each condition: ceiling gap and loss in vLLM's default mode."""
    present = [
        v
        for v in VERIFIERS
        if any(v in r.get("acceptance", {}) for r in rs.regimes[regime].values())
    ]
    verifier = present[-1] if present else None  # the captured target where the regime has one
    label = VLLM_DEFAULT_MODE.label

    def acceptance(name: str | None) -> dict | None:
        result = rs.regimes[regime].get(name) if name is not None else None
        return None if result is None else result.get("acceptance", {}).get(verifier)

    def ceiling(name: str | None) -> float | None:
        prefix = None if name is None else _prefix(metrics(rs, regime, name), "greedy")
        return None if prefix is None else prefix["value"]

    rows = []
    for v, default in conditions:
        emitted = [(acc or {}).get(VLLM_DEFAULT_MODE.name, {}).get("emitted")
                   for acc in (acceptance(default), acceptance(v.name))]  # fmt: skip
        loss = _emitted_and_loss(acceptance(v.name), VLLM_DEFAULT_MODE.name)[1]
        rows.append([
            Cell(v.name), _gap(ceiling(v.name), ceiling(FLOOR)), loss,
            Cell("n/a") if default is None else _gap(ceiling(v.name), ceiling(default)),
            _loss_vs_default(default, loss, tuple(emitted)),
        ])  # fmt: skip
    temps = {  # vLLM's default mode's, from the results
        acc[VLLM_DEFAULT_MODE.name]["mode"]["temperature"]
        for r in rs.regimes[regime].values()
        if VLLM_DEFAULT_MODE.name in (acc := r.get("acceptance", {}).get(verifier) or {})
    }
    caption = CAPTION.format(
        mode=label,
        verifier=VERIFIERS[verifier] if verifier else "no verifier (not simulated in this regime)",
        temps=", ".join(f"T={t}" for t in sorted(temps)) or "no temperature (nothing simulated)",
        unpaired=UNPAIRED,
    )
    columns = ["condition", "ceiling gap to bf16", f"loss vs bf16, {label} [95% CI]",
               "ceiling gap to default", "loss vs default"]  # fmt: skip
    return Table(f"Regime {regime}: {caption}", columns, rows, key=f"serving_{regime}")


def measured_conditions_table(spec: dict, conditions: list) -> Table:
    """The conditions measured with the target in the loop (``qstream speculate``)."""
    d = DIGITS["ceiling"]
    variants = spec["variants"]
    rows = []
    for v, default in conditions:
        length = variants[v.name]["summary"]["mean_acceptance_length"]
        theirs = None if default is None else variants[default]["summary"]["mean_acceptance_length"]
        loss = difference(variants[v.name]["summary"].get("loss_vs_bf16"))
        name, words, weights, same, avoided = _described(v, default)
        vs_default = _loss_vs_default(default, loss, (theirs, length))
        rows.append([name, words, weights, estimate(length, d), loss, same, vs_default, avoided])
    s = spec["settings"]
    temperature = s.get("temperature")
    at = "temperature not recorded" if temperature is None else f"T={temperature}"
    columns = ["condition", "what differs", "weights", "tokens per verification [95% CI]",
               "loss vs bf16 [95% CI]", SAME, "loss vs default", AVOIDED]  # fmt: skip
    return Table(
        f"Measured with the target in the loop (`qstream speculate`, {s['rule']} verification at "
        f"{at}): one row per variant served otherwise than the default. The loss against bf16 "
        "is paired over the same prompts, as speculate reports it; against the same weights at "
        "the default it is that loss where those weights are bf16's, else the difference of the "
        f"two tokens per verification, {UNPAIRED} (no interval)",
        columns,
        rows,
        key="serving_measured",
        align="lllrrlrl",
    )


def conditions_tables(rs: ResultsSet) -> list[Table]:
    """What the conditions of the eval-drift results are, then per regime holding one what
    they cost (none when every variant is served at the default).  Each variant's configuration
    is read from ``variants.NAME`` or, where eval-drift's passes record it, from its entry in a
    regime (one token names one configuration)."""
    variants = {}
    for name in variant_order(rs):
        held = [r for r in regime_order(rs) if name in rs.regimes[r]]
        entries = [rs.variants[name], *(rs.regimes[r][name] for r in held)]
        recorded = next((e["configuration"] for e in entries if "configuration" in e), DEFAULTS)
        files = ", ".join(sorted({p for r in held for p in rs.sources[r]}))
        variants[name] = served(name, {**rs.variants[name], "configuration": recorded}, files)
    conditions = _conditions(variants)
    if not conditions:
        return []
    costs = [
        costs_table(rs, r, here)
        for r in regime_order(rs)
        if (here := [c for c in conditions if c[0].name in rs.regimes[r]])
    ]
    rows = [_described(v, default) for v, default in conditions]
    defaults = ", ".join(f"{f} {d}" for f, d in DEFAULTS.items())
    described = Table(
        f"Serving conditions: the variants served otherwise than the default configuration "
        f"({defaults}), what differs, their weights, the variant of the run that serves the "
        "same weights at the default, and the vLLM 0.32.0 setting that avoids the condition",
        ["condition", "what differs", "weights", SAME, AVOIDED],
        rows,
        key="serving_conditions",
        align="lllll",
    )
    return [described, *costs]


def serving_sections(rs: ResultsSet, speculate: dict | None) -> list[Section]:
    """The "Serving conditions" section, or none when every variant is served at the default."""
    parts: list = conditions_tables(rs)
    if speculate is not None:
        measured = _conditions(
            {n: served(n, info, "speculate results") for n, info in speculate["variants"].items()}
        )
        if measured:
            parts.append(measured_conditions_table(speculate, measured))
    if not parts:
        return []
    intro = (
        "A serving condition is a variant served otherwise than the default configuration: "
        "activations quantized, a KV cache other than the draft's compute dtype, or a quantized "
        "target (docs/eval-drift.md). The first table names what differs and the vLLM 0.32.0 "
        "setting that avoids it (the draft's own KV cache dtype: `vllm/config/speculative.py`, "
        "`SpeculativeConfig.kv_cache_dtype`; unset, the draft inherits the target's "
        "`--kv-cache-dtype`); the others what it costs against bf16 and against the same "
        "weights served at the default."
    )
    return [Section("Serving conditions", [intro, *parts])]
