"""The card's tables built from a merged results set.

Every number shown is a number of the results JSON, printed with a fixed number of decimals
(``DIGITS``); the one exception is the gap to the bf16 floor, a difference of two values shown in
the same table, and its column header says so.  Every difference against bf16 in tokens, a gap
or a loss, copied or computed, is printed by :func:`difference`: signed, one format card-wide.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from qstream.card.results import ResultsSet
from qstream.eval.vocabulary import (
    CONFIDENCE_NOTE,
    FLOOR,
    PREFIX_KEYS,
    PREFIX_LABELS,
    ROLLOUT_MODES,
    rollout_label,
)
from qstream.regimes import AUX_REGIMES
from qstream.tablefit import Cell, Table

# Decimals per kind of number: agreement proportions and r are read to a tenth of a percent,
# 1−TV sits close to 1 so it gets one more, the ceiling is a length in tokens (0..B); a
# difference against bf16 in tokens (small next to the lengths it compares) gets one more.
DIGITS = {"proportion": 3, "one_minus_tv": 4, "ceiling": 2, "difference": 3, "snr": 1}


def fixed(x: float | None, digits: int) -> Cell:
    return Cell("n/a" if x is None else f"{x:.{digits}f}", x)


def sci(x: float | None) -> Cell:
    return Cell("n/a" if x is None else f"{x:.2e}", x)


def estimate(e: dict | None, digits: int) -> Cell:
    """``value [lo, hi]`` of an eval-drift Estimate; a missing bound (one block) shows the value."""
    return Cell("n/a", e) if e is None else interval(e, f".{digits}f")


def interval(e: dict, spec: str) -> Cell:
    """:func:`estimate` of a present estimate, each number written with format ``spec``."""
    if e.get("value") is None:
        return Cell("n/a", e)
    if e.get("lo") is None or e.get("hi") is None:
        return Cell(f"{e['value']:{spec}}", e)
    return Cell(f"{e['value']:{spec}} [{e['lo']:{spec}}, {e['hi']:{spec}}]", e)


def difference(e: dict | float | None) -> Cell:
    """A difference against bf16 in tokens (a gap or a loss) with its sign: a number, or an
    estimate with its interval."""
    spec = f"+.{DIGITS['difference']}f"
    if isinstance(e, dict):
        return interval(e, spec)
    return Cell("n/a" if e is None else f"{e:{spec}}", e)


# ---------------------------------------------------------------------------------------------
# Order


def regime_order(rs: ResultsSet) -> list[str]:
    """Regimes present, in docs/eval-drift.md's order (gauss, heavy, boot), any other after."""
    known = [r for r in AUX_REGIMES if r in rs.regimes]
    return known + [r for r in rs.regimes if r not in AUX_REGIMES]


def variant_order(rs: ResultsSet) -> list[str]:
    """Variants present in some regime, the bf16 floor first, then as the results list them."""
    present = [v for v in rs.variants if any(v in block for block in rs.regimes.values())]
    return sorted(present, key=lambda v: v != FLOOR)


def rollout_name(rs: ResultsSet, mode: str, regimes: list[str] | None = None) -> str:
    """The rollout mode's label with the sampling settings the runs of ``regimes`` (default:
    all) recorded; when they differ, the label says so instead of picking one."""
    names = list(
        dict.fromkeys(
            rollout_label(mode, rs.runs[r].get("sampling"))
            for r in (regimes if regimes is not None else regime_order(rs))
        )
    )
    if len(names) == 1:
        return names[0]
    return f"{mode} rollout (settings differ by regime: see how it was evaluated)"


def metrics(rs: ResultsSet, regime: str, variant: str) -> dict | None:
    result = rs.regimes.get(regime, {}).get(variant)
    return None if result is None else result["metrics"]


# ---------------------------------------------------------------------------------------------
# Result tables


def agreement_table(rs: ResultsSet, regime: str) -> Table:
    """Per-position agreement, k = 1..B: teacher-forced greedy agree, and the rollouts' seq agree
    (token k) and prefix agree (tokens 1..k), the quantities of seq_agree.png."""
    B = rs.block_size
    d = DIGITS["proportion"]
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
            rows.append([Cell(variant), Cell(name), *(fixed(e["value"], d) for e in per_k)])
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
    """The mean matched prefix of one rollout mode (greedy: the ceiling), variants × regimes,
    with the 95% CI and the gap to the bf16 floor."""
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
    """The variant's name, and how many tensors it quantized when the quantized variants of the
    results did not all quantize the same tensors (then they are not compared like for like)."""
    changed = {
        name: {
            tuple(r.get("quantized_tensors") or ())
            for block in rs.regimes.values()
            if (r := block.get(name)) is not None
        }
        for name in variant_order(rs)
    }
    sets = {s for name, found in changed.items() for s in found if s}
    mine = [s for s in changed.get(variant, set()) if s]
    if len(sets) <= 1 or not mine:
        return variant
    return f"{variant} (quantizes {len(mine[0])} tensors; quantized sets differ)"


def full_metrics_table(rs: ResultsSet, regime: str) -> Table:
    """Every headline metric of one regime, one column per variant."""
    variants = [v for v in variant_order(rs) if metrics(rs, regime, v) is not None]
    rows = [
        [Cell(name), *(cell_of(rs.regimes[regime][v]) for v in variants)]
        for name, cell_of in _agreement_rows(rs, regime) + _divergence_rows()
    ]
    return Table(
        f"Regime {regime}: every metric against the FP32 reference "
        "(n/a: undefined for that variant, e.g. no weight error in bf16)",
        ["metric", *(variant_label(rs, v) for v in variants)],
        rows,
        key=f"metrics_{regime}",
    )


RowOf = Callable[[dict], Cell]  # a variant's results entry -> its cell in one row


def _agreement_rows(rs: ResultsSet, regime: str) -> list[tuple[str, RowOf]]:
    """Greedy agreement, 1−TV and, per rollout mode, the matched prefix and whole blocks."""
    p, tv, c = DIGITS["proportion"], DIGITS["one_minus_tv"], DIGITS["ceiling"]
    rows: list[tuple[str, RowOf]] = [
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
    return rows


def _divergence_rows() -> list[tuple[str, RowOf]]:
    """KL both ways, the confidence head's metrics and the weight SNR."""
    p, snr = DIGITS["proportion"], DIGITS["snr"]
    return [
        ("KL(ref‖var) mean [95% CI]", lambda r: interval(r["metrics"]["kl"]["mean"], ".2e")),
        ("KL(ref‖var) p99", lambda r: sci(r["metrics"]["kl"]["p99"])),
        ("reverse KL(var‖ref) mean [95% CI]",
         lambda r: interval(r["metrics"]["reverse_kl"]["mean"], ".2e")),
        ("reverse KL(var‖ref) p99", lambda r: sci(r["metrics"]["reverse_kl"]["p99"])),
        (f"confidence r, {CONFIDENCE_NOTE} [95% CI]",
         lambda r: estimate(r["metrics"]["confidence_r"], p)),
        (f"sched flip rate, {CONFIDENCE_NOTE} [95% CI]",
         lambda r: estimate(r["metrics"]["sched_flip_rate"], p)),
        ("weight SNR, overall (dB)", lambda r: fixed(r["weight_snr"]["overall_db"], snr)),
        ("weight SNR, worst tensor (dB)", lambda r: fixed(r["weight_snr"]["worst_db"], snr)),
        ("weight SNR over (tensors)",
         lambda r: Cell(str(r["weight_snr"]["tensors"]), r["weight_snr"]["tensors"])),
    ]  # fmt: skip


def _rollout(result: dict, mode: str, what: str, digits: int) -> Cell:
    rollout = result["metrics"]["rollouts"].get(mode)
    if rollout is None:
        return Cell("n/a")
    return estimate(rollout[what][-1] if what == "prefix_agree" else rollout[what], digits)


# ---------------------------------------------------------------------------------------------
# How it was evaluated


def per_regime(rs: ResultsSet, regimes: list[str], describe) -> str:
    """One value when every regime's run agrees, else ``regime: value`` for each."""
    values = {regime: describe(rs.runs[regime]) for regime in regimes}
    distinct = list(dict.fromkeys(values.values()))
    if len(distinct) == 1:
        return distinct[0]
    return "; ".join(f"{regime}: {value}" for regime, value in values.items())
