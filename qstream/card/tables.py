"""The card's tables from a merged results set (docs/card.md), also what ``qstream eval-drift``
prints: every number is one of the results JSON at ``DIGITS`` decimals, except the gap to bf16
(a difference of two shown values, printed by :func:`difference`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from qstream.card.document import Code, Part
from qstream.card.results import ResultsSet
from qstream.eval.vocabulary import (
    CONFIDENCE_NOTE,
    FLOOR,
    PREFIX_KEYS,
    PREFIX_LABELS,
    ROLLOUT_MODES,
    VERIFIERS,
    rollout_label,
    verifier_label,
)
from qstream.regimes import AUX_REGIMES, REGIMES
from qstream.serving import DEFAULTS, Variant
from qstream.tablefit import Cell, Table
from qstream.verification import ADAPTIVE_MODES, HEADLINE_MODES, MODES, VerificationMode

# Decimals per kind of number: proportions and r to a tenth of a percent, 1−TV (close to 1) one
# more, the ceiling in tokens (0..B) two, a difference against bf16 in tokens one more.
DIGITS = {"proportion": 3, "one_minus_tv": 4, "ceiling": 2, "difference": 3, "snr": 1}


def number(x: float | None, spec: str) -> Cell:
    return Cell("n/a" if x is None else f"{x:{spec}}", x)


def estimate(e: dict | None, digits: int) -> Cell:
    """``value [lo, hi]`` of an eval-drift Estimate; a missing bound (one block) shows the value."""
    return Cell("n/a", e) if e is None else interval(e, f".{digits}f")


def interval(e: dict, spec: str) -> Cell:
    if e.get("value") is None:
        return Cell("n/a", e)
    if e.get("lo") is None or e.get("hi") is None:
        return Cell(f"{e['value']:{spec}}", e)
    return Cell(f"{e['value']:{spec}} [{e['lo']:{spec}}, {e['hi']:{spec}}]", e)


def difference(e: dict | float | None) -> Cell:
    """A signed difference against bf16 in tokens: a number, or an estimate with its interval."""
    spec = f"+.{DIGITS['difference']}f"
    return interval(e, spec) if isinstance(e, dict) else number(e, spec)


def regime_order(rs: ResultsSet) -> list[str]:
    """Regimes present, in docs/eval-drift.md's order (gauss, heavy, boot), any other after."""
    known = [r for r in AUX_REGIMES if r in rs.regimes]
    return known + [r for r in rs.regimes if r not in AUX_REGIMES]


def variant_order(rs: ResultsSet) -> list[str]:
    """Variants present in some regime, the bf16 floor first, then as the results list them."""
    present = [v for v in rs.variants if any(v in block for block in rs.regimes.values())]
    return sorted(present, key=lambda v: v != FLOOR)


def rollout_name(rs: ResultsSet, mode: str, regimes: list[str] | None = None) -> str:
    """The rollout mode's label with the sampling settings of ``regimes`` (default: all)."""
    regimes = regime_order(rs) if regimes is None else regimes
    names = {rollout_label(mode, rs.runs[r].get("sampling")) for r in regimes}
    if len(names) == 1:
        return names.pop()
    return f"{mode} rollout (settings differ by regime: see how it was evaluated)"


def metrics(rs: ResultsSet, regime: str, variant: str) -> dict | None:
    result = rs.regimes.get(regime, {}).get(variant)
    return None if result is None else result["metrics"]


def agreement_table(rs: ResultsSet, regime: str) -> Table:
    """Per-position agreement, k = 1..B: greedy agree, the rollouts' seq and prefix agree."""
    B = rs.block_size
    spec = f".{DIGITS['proportion']}f"
    rows = []
    for variant in variant_order(rs):
        m = metrics(rs, regime, variant)
        if m is None:
            continue
        measures = [("greedy agree (teacher-forced)", m["greedy_agree"])]
        for mode in ROLLOUT_MODES:
            if mode in m["rollouts"]:
                name = rollout_name(rs, mode, [regime])
                measures.append((f"seq agree (token k), {name}", m["rollouts"][mode]["seq_agree"]))
                measures.append(
                    (f"prefix agree (tokens 1..k), {name}", m["rollouts"][mode]["prefix_agree"])
                )
        for name, per_k in measures:
            rows.append([Cell(variant), Cell(name), *(number(e["value"], spec) for e in per_k)])
    return Table(
        f"Regime {regime}: agreement with the FP32 reference by drafted position k, each a share "
        "of all blocks (point estimates; the card's seq_agree.png draws the rollouts' 95% "
        "intervals)",
        ["variant", "measure", *(str(k) for k in range(1, B + 1))],
        rows,
        key=f"agreement_{regime}",
        align="ll" + "r" * B,
    )


def _gap(value: float | None, floor: float | None) -> Cell:
    return difference(None if value is None or floor is None else value - floor)


def _prefix(m: dict | None, mode: str) -> dict | None:
    """The rollout mode's mean matched prefix (greedy: the ceiling), or None if not evaluated."""
    rollout = None if m is None else m["rollouts"].get(mode)
    return None if rollout is None else rollout.get(PREFIX_KEYS[mode])


PREFIX_CAPTIONS = {
    "greedy": "Drift-limited acceptance ceiling under greedy drafting",
    "sampled": "Sampled matched prefix: a lower bound on acceptance under probabilistic "
    "drafting, not a ceiling (the verifier also accepts where two coupled draws part; "
    "simulated acceptance, --acceptance, measures it)",
}


def ceiling_table(rs: ResultsSet, mode: str) -> Table:
    """One rollout mode's mean matched prefix, variants × regimes, with the gap to bf16."""
    d = DIGITS["ceiling"]
    regimes = regime_order(rs)
    columns = ["variant"]
    for regime in regimes:
        columns += [f"{regime} [95% CI]", f"{regime} gap to bf16"]
    rows = []
    for variant in variant_order(rs):
        row = [Cell(variant_label(rs, variant))]
        for regime in regimes:
            prefix = _prefix(metrics(rs, regime, variant), mode)
            if prefix is None:
                row += [Cell("not evaluated"), Cell("n/a")]
                continue
            row.append(estimate(prefix, d))
            if variant == FLOOR:
                row.append(Cell("(floor)"))
            else:
                floor = _prefix(metrics(rs, regime, FLOOR), mode)
                row.append(_gap(prefix["value"], None if floor is None else floor["value"]))
        rows.append(row)
    return Table(
        f"{PREFIX_CAPTIONS[mode]}, {rollout_name(rs, mode)}: mean matched prefix of the "
        f"{rs.block_size} drafted tokens (0..{rs.block_size}). The gap to bf16 is the "
        "variant's value minus bf16's in the same regime, a difference computed for this "
        "card",
        columns,
        rows,
        key=f"{PREFIX_KEYS[mode]}_{mode}",
    )


def variant_label(rs: ResultsSet, variant: str) -> str:
    """The variant's name, and its count of quantized tensors when the quantized variants did
    not all quantize the same tensors (then they are not compared like for like)."""

    def quantized(name: str) -> set[tuple]:  # its non-empty sets of quantized tensors
        found = (block.get(name) or {} for block in rs.regimes.values())
        return {t for r in found if (t := tuple(r.get("quantized_tensors") or ()))}

    sets = set().union(*(quantized(name) for name in variant_order(rs)))
    mine = list(quantized(variant))
    if len(sets) <= 1 or not mine:
        return variant
    return f"{variant} (quantizes {len(mine[0])} tensors; quantized sets differ)"


def full_metrics_table(rs: ResultsSet, regime: str) -> Table:
    """Every headline metric of one regime, one column per variant."""
    variants = [v for v in variant_order(rs) if metrics(rs, regime, v) is not None]
    p, tv, c = (DIGITS[k] for k in ("proportion", "one_minus_tv", "ceiling"))
    snr = f".{DIGITS['snr']}f"
    rows: list[tuple[str, Callable[[dict], Cell]]] = [  # a variant's results entry -> its cell
        ("greedy agree, all positions [95% CI]",
         lambda r: estimate(r["metrics"]["greedy_agree_overall"], p)),
        ("1−TV, all positions [95% CI]",
         lambda r: estimate(r["metrics"]["one_minus_tv_overall"], tv)),
    ]  # fmt: skip
    for mode in ROLLOUT_MODES:
        name = rollout_name(rs, mode, [regime])
        rows.append((f"{PREFIX_LABELS[mode]}, {name} [95% CI]",
                     partial(_rollout, mode=mode, what=PREFIX_KEYS[mode], digits=c)))  # fmt: skip
        rows.append((f"whole block of {rs.block_size} matched, {name} [95% CI]",
                     partial(_rollout, mode=mode, what="prefix_agree", digits=p)))  # fmt: skip
    rows += [
        ("KL(ref‖var) mean [95% CI]", lambda r: interval(r["metrics"]["kl"]["mean"], ".2e")),
        ("KL(ref‖var) p99", lambda r: number(r["metrics"]["kl"]["p99"], ".2e")),
        ("reverse KL(var‖ref) mean [95% CI]",
         lambda r: interval(r["metrics"]["reverse_kl"]["mean"], ".2e")),
        ("reverse KL(var‖ref) p99", lambda r: number(r["metrics"]["reverse_kl"]["p99"], ".2e")),
        (f"confidence r, {CONFIDENCE_NOTE} [95% CI]",
         lambda r: estimate(r["metrics"]["confidence_r"], p)),
        (f"sched flip rate, {CONFIDENCE_NOTE} [95% CI]",
         lambda r: estimate(r["metrics"]["sched_flip_rate"], p)),
        ("weight SNR, overall (dB)", lambda r: number(r["weight_snr"]["overall_db"], snr)),
        ("weight SNR, worst tensor (dB)", lambda r: number(r["weight_snr"]["worst_db"], snr)),
        ("weight SNR over (tensors)",
         lambda r: Cell(str(r["weight_snr"]["tensors"]), r["weight_snr"]["tensors"])),
    ]  # fmt: skip
    return Table(
        f"Regime {regime}: every metric against the FP32 reference "
        "(n/a: undefined for that variant, e.g. no weight error in bf16)",
        ["metric", *(variant_label(rs, v) for v in variants)],
        [
            [Cell(name), *(cell_of(rs.regimes[regime][v]) for v in variants)]
            for name, cell_of in rows
        ],
        key=f"metrics_{regime}",
    )


def _rollout(result: dict, mode: str, what: str, digits: int) -> Cell:
    rollout = result["metrics"]["rollouts"].get(mode)
    if rollout is None:
        return Cell("n/a")
    return estimate(rollout[what][-1] if what == "prefix_agree" else rollout[what], digits)


def per_regime(rs: ResultsSet, regimes: list[str], describe) -> str:
    """One value when every regime's run agrees, else ``regime: value`` for each."""
    values = {regime: describe(rs.runs[regime]) for regime in regimes}
    distinct = list(dict.fromkeys(values.values()))
    if len(distinct) == 1:
        return distinct[0]
    return "; ".join(f"{regime}: {value}" for regime, value in values.items())


def _corpus(run: dict) -> str:
    c = run["corpus"] or {}
    return (
        f"{c.get('corpus')} (sha256 {c.get('sha256')}, {c.get('streams')} streams, "
        f"{c.get('tokens')} tokens)"
    )


def _anchors(run: dict) -> str:
    a = run["anchors"] or {}
    source = (
        f"the blocks {a['file']} names (sha256 {a.get('file_sha256')}); "
        if a.get("file")
        else "drawn uniformly; "
    )
    return (
        f"{source}context length mean {a.get('context_length_mean'):.1f}, min "
        f"{a.get('context_length_min')}, max {a.get('context_length_max')} tokens"
    )


def _sampling(run: dict) -> str:
    s = run["sampling"] or {}
    return f"drafter {rollout_label('sampled', s)}; verifier {verifier_label(s)}; {s.get('noise')}"


def _selection(run: dict) -> str:
    s = run["selection"] or {}
    return (
        f"include {' '.join(s.get('include') or []) or '(default)'}; "
        f"ignore {' '.join(s.get('ignore') or []) or '(none)'}"
    )


def _evaluation_rows(rs: ResultsSet, regimes: list[str]) -> list[tuple[str, Any]]:
    """Each row's name and value: a text, or a run's text (run -> text) shown by per_regime."""
    model, params = rs.model, rs.model.get("parameters")
    params = f"{params:,}" if isinstance(params, int) else params
    variants = (
        f"{name}: {info.get('kind')} ({info.get('source')})" for name, info in rs.variants.items()
    )
    described = (
        f"{r}: {REGIMES[r].description if r in REGIMES else 'see the results'}" for r in regimes
    )
    files = (f"{r}: {', '.join(Path(p).name for p in rs.sources[r])}" for r in regimes)
    return [
        ("model", f"{model.get('path')} ({model.get('architecture')}, {params} parameters as "
                  "eval-drift loads it: its own tensors and the embed_tokens it borrows from the "
                  "target, if any, without lm_head; config.json sha256 "
                  f"{model.get('config_sha256')})"),
        ("target head from", lambda r: r["target"] or "not given"),
        ("reference", lambda r: r["reference"]),
        ("variants", "; ".join(variants)),
        ("variant compute", lambda r: r["variant_compute"]),
        ("confidence head", CONFIDENCE_NOTE),
        ("aux states", lambda r: f"shared by reference and variants, {r['aux_dtype']}"),
        ("regimes", "; ".join(described)),
        ("corpus", _corpus),
        ("tokenizer",
         lambda r: (r.get("corpus") or {}).get("tokenizer") or "not recorded in the results"),
        ("blocks per regime", lambda r: f"{r['blocks']} blocks of {r['block_size']} tokens"),
        ("anchors", _anchors),
        ("sampled rollouts", _sampling),
        ("modules the simulated formats quantize", _selection),
        ("seed", lambda r: str(r["seed"])),
        ("intervals", "95%, two-sided: Wilson score for per-position proportions; Wilson on "
                      "Kish's effective sample size for pooled proportions and B times them "
                      "(matched prefix, greedy acceptance); Student-t over blocks for other "
                      "means; a seeded block bootstrap for r"),
        ("versions", lambda r: f"qstream {r['qstream_version']}, torch {r['torch_version']}"),
        ("computed on", _computed_on(rs, regimes)),
        ("results files", "; ".join(files)),
    ]  # fmt: skip


def _computed_on(rs: ResultsSet, regimes: list[str]) -> str:
    """Device, torch's CPU kernels and threads of every file: float results follow all three."""
    texts = []
    for c in (c for r in regimes for c in rs.computed.get(r, {}).values()):
        if not c:
            texts.append("not recorded in the results")
        elif c["device"] != "cpu":
            texts.append(f"{c['device']} ({c['device_name']})")
        else:
            kernels = c.get("cpu_capability") or "not recorded"
            texts.append(f"{c['device']} ({c['device_name']}), torch CPU kernels {kernels}, "
                         f"{c['threads']} threads")  # fmt: skip
    return "; ".join(dict.fromkeys(texts)) or "not recorded"


def evaluation_table(rs: ResultsSet) -> Table:
    regimes = regime_order(rs)
    rows = [
        [Cell(k), Cell(v if isinstance(v, str) else per_regime(rs, regimes, v))]
        for k, v in _evaluation_rows(rs, regimes)
    ]
    return Table(
        "How the numbers were measured (from the results JSON)",
        ["", "value"],
        rows,
        key="evaluation",
        align="ll",
    )


SENSITIVITY_COLUMNS = ["+ module kind", "gap alone", "ceiling, greedy [95% CI]", "gap to bf16",
                       "KL p99", "tensors", "within"]  # fmt: skip


def sensitivity_table(rs: ResultsSet, regime: str) -> Table:
    """The cumulative steps (least harmful kind first) with each kind's cost alone beside."""
    sens = rs.sections[regime]["sensitivity"]
    d = DIGITS["ceiling"]
    alone = {e["kind"]: e for e in sens["single"]}
    floor = sens["floor"]
    rows = [[Cell("(nothing: bf16 floor)"), Cell(""), estimate(floor["ceiling"], d),
             Cell("(floor)"), number(floor["kl_p99"], ".2e"), Cell(""), Cell("")]]  # fmt: skip
    for e in sens["cumulative"]:
        n = len(e["quantized_tensors"])
        rows.append([Cell(e["add"]), difference(alone[e["add"]]["ceiling_gap"]),
                     estimate(e["ceiling"], d), difference(e["ceiling_gap"]),
                     number(e["kl_p99"], ".2e"), Cell(str(n), n),
                     Cell("yes" if e["within_tolerance"] else "no")])  # fmt: skip
    served = sens.get("configuration", DEFAULTS)  # a serving configuration's token names it
    probed = Variant("sensitivity", "simulated", sens["format"], **served).token(sens["format"])
    return Table(
        f"Regime {regime}: {probed} quantized one module kind more per row, least "
        f"harmful first (harm: {sens['harm']}). 'alone' is the kind's gap when quantized "
        f"by itself; 'within' compares the cumulative gap with the tolerance of "
        f"{sens['tolerance']} tokens",
        SENSITIVITY_COLUMNS,
        rows,
        key=f"sensitivity_{regime}",
        align="lrrrrrl",
    )


def context_sweep_table(rs: ResultsSet, regime: str) -> Table:
    """Greedy ceiling per context-length bucket (rows) and variant (columns)."""
    sweep = rs.sections[regime]["context_sweep"]
    names = [v for v in variant_order(rs) if v in sweep["buckets"][0]["variants"]]
    rows = [
        [Cell(f"[{b['lo']}, {b['hi']})"), Cell(b["side"]),
         Cell(f"{(mean := b['anchors']['context_length_mean']):.1f}", mean),
         *(estimate(b["variants"][v]["metrics"]["rollouts"]["greedy"]["ceiling"], DIGITS["ceiling"])
           for v in names)]
        for b in sweep["buckets"]
    ]  # fmt: skip
    return Table(
        f"Regime {regime}: acceptance ceiling (greedy rollout, 95% CI) by context length "
        f"of the block; YaRN boundary (original_max_position_embeddings) "
        f"{sweep['yarn_boundary']}, max_position_embeddings "
        f"{sweep['max_position_embeddings']}",
        ["context length", "vs boundary", "mean context", *names],
        rows,
        key=f"context_sweep_{regime}",
        align="llr" + "r" * len(names),
    )


def all_acceptance_tables(rs: ResultsSet) -> list[Table]:
    """:func:`acceptance_tables` of each verifier in some variant's results, in VERIFIERS order."""
    found = {v for block in rs.regimes.values() for res in block.values()
             for v in res.get("acceptance", {})}  # fmt: skip
    return [t for v in VERIFIERS if v in found for t in acceptance_tables(rs, v)]


OTHER_MODES = tuple(m for m in MODES.values() if m not in HEADLINE_MODES and not m.adaptive)
_CAPTIONS = {
    "headline": "vLLM 0.32's default mode (greedy draft: the drafter's argmax at any "
    "temperature, a one-hot draft to the rejection sampler; token-wise verification) beside "
    "the mode a published DSpark card reports (probabilistic draft, block verification)",
    "other": "the other modes: greedy draft under block verification (the same law as "
    "token-wise for a one-hot draft), probabilistic draft under token-wise verification, and a "
    "greedy verifier (temperature 0)",
}
_COLUMNS = ["mode", "regime", "variant", "tokens/step [95% CI]", "loss vs bf16"]


def acceptance_tables(rs: ResultsSet, verifier: str) -> list[Table]:
    """The acceptance by ``verifier``: headline modes, the other modes, adaptive (if simulated)."""
    tables = []
    for which, modes in (("headline", HEADLINE_MODES), ("other", OTHER_MODES)):
        sampling = per_regime(rs, regime_order(rs), lambda r: verifier_label(r.get("sampling")))
        caption = (
            f"Expected tokens per verification step, verified by {VERIFIERS[verifier]}: "
            f"{_CAPTIONS[which]}. Accepted drafted tokens plus the resampled or bonus token "
            f"(1..{rs.block_size + 1}); a probabilistic drafter samples its full tempered "
            f"softmax, a sampling verifier is at {sampling}; loss vs bf16 is the results' "
            "paired per-block difference"
        )
        rows = _acceptance_rows(rs, verifier, modes, _emitted_and_loss)
        key = f"acceptance_{verifier}" + ("" if which == "headline" else f"_{which}")
        tables.append(Table(caption, _COLUMNS, rows, key=key, align="lllrr"))
    adaptive = [
        acc[mode.name]["mode"].get("adaptive")
        for mode in ADAPTIVE_MODES
        for block in rs.regimes.values()
        for res in block.values()
        if mode.name in (acc := res.get("acceptance", {}).get(verifier) or {})
    ]
    if adaptive:
        tables.append(_adaptive_table(rs, verifier, {(a["requests"], a["budget_share"])
                                                     for a in adaptive if a}))  # fmt: skip
    return tables


def _acceptance_rows(
    rs: ResultsSet, verifier: str, modes: tuple[VerificationMode, ...], cells
) -> list[list[Cell]]:
    """One row per mode, regime and variant; ``cells(acc, mode)`` gives the value cells."""
    regimes = [
        r
        for r in regime_order(rs)
        if any(verifier in res.get("acceptance", {}) for res in rs.regimes[r].values())
    ]
    rows = []
    for mode in modes:
        for regime in regimes:
            for variant in variant_order(rs):
                res = rs.regimes[regime].get(variant) or {}
                acc = res.get("acceptance", {}).get(verifier)
                rows.append(
                    [Cell(mode.label), Cell(regime), Cell(variant_label(rs, variant)),
                     *cells(acc, mode.name)]
                )  # fmt: skip
    return rows


def _emitted_and_loss(acc: dict | None, mode: str) -> list[Cell]:
    """A mode's expected tokens and paired loss against bf16, or why they are absent."""
    d = DIGITS["ceiling"]
    if acc is None:
        return [Cell("not evaluated"), Cell("n/a")]
    if mode not in acc:
        return [Cell("not simulated"), Cell("n/a")]
    loss = acc.get("loss_vs_bf16")
    if loss is None:
        return [estimate(acc[mode]["emitted"], d), Cell("(floor)")]
    return [estimate(acc[mode]["emitted"], d), difference(loss.get(mode))]


def _adaptive_table(rs: ResultsSet, verifier: str, settings: set[tuple]) -> Table:
    """Each adaptive mode's expected tokens and loss, and what vLLM's budget rule expects."""
    d = DIGITS["ceiling"]

    def cells(acc: dict | None, mode: str) -> list[Cell]:
        entry = (acc or {}).get(mode)
        estimated = Cell("n/a") if entry is None else estimate(entry["estimated_emitted"], d)
        return [*_emitted_and_loss(acc, mode), estimated]

    setting = "; ".join(
        f"blocks verified {r} at a time as one batch's requests, whose budget is {share:g} of "
        "their drafted tokens"
        for r, share in sorted(settings)
    )
    return Table(
        f"Adaptive verification (vLLM 0.32's enable_adaptive_verification), verified by "
        f"{VERIFIERS[verifier]}: {setting}; each request keeps the "
        "drafted positions that rank in the batch's budget by the running product of its "
        "confidence scores, as vLLM ranks them. Tokens per step as above; vLLM's estimate is "
        "what its budget rule expects a block to emit (1 + the survival of its verified "
        "positions), the confidence head's prediction of the target's acceptance. vLLM sizes "
        "the budget from step costs it profiles on its GPU; here it is a setting "
        "(docs/acceptance.md)",
        [*_COLUMNS, "vLLM's estimate [95% CI]"],
        _acceptance_rows(rs, verifier, ADAPTIVE_MODES, cells),
        key=f"acceptance_{verifier}_adaptive",
        align="lllrrr",
    )


def sensitivity_parts(rs: ResultsSet, regime: str) -> list[Part]:
    return [sensitivity_table(rs, regime), suggested_command(rs, regime)]


def suggested_command(rs: ResultsSet, regime: str) -> Part:
    """The quantize command of the largest include list within tolerance, or why there is none."""
    sens = rs.sections[regime]["sensitivity"]
    best = sens["suggested"]
    if best["command"]:
        return Code(f"qstream quantize --quant_format {sens['format']} {best['command']}")
    fmt, tolerance = sens["format"], sens["tolerance"]
    keeps = (
        f"keeps the greedy acceptance ceiling within the tolerance of {tolerance} tokens of the "
        "bf16 floor"
    )
    gentlest = max(sens["single"], key=lambda e: e["ceiling_gap"], default=None)
    if gentlest is None:
        return f"Regime {regime}: the model has no module kind {fmt} can hold; nothing to suggest."
    if gentlest["ceiling_gap"] < -tolerance:
        return (
            f"Regime {regime}: no module kind quantized to {fmt} {keeps}, even alone: the least "
            f"harmful, {gentlest['kind']}, lowers it by "
            f"{-gentlest['ceiling_gap']:.{DIGITS['difference']}f} tokens. "
            "No include list is suggested."
        )
    return (
        f"Regime {regime}: no step of the table (module kinds quantized to {fmt}, added one by "
        f"one) {keeps}. No include list is suggested."
    )
