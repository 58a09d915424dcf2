"""The card's tables of the optional studies: per-module sensitivity, the context-length sweep
and simulated acceptance under vLLM's verification rules (docs/card.md).  Cells and orderings
come from :mod:`qstream.card.tables`."""

from __future__ import annotations

from qstream.card.results import ResultsSet
from qstream.card.tables import (
    DIGITS,
    difference,
    estimate,
    per_regime,
    regime_order,
    sci,
    variant_label,
    variant_order,
)
from qstream.eval.vocabulary import (
    ACCEPTANCE_MODES,
    ADAPTIVE_MODES,
    HEADLINE_MODES,
    VERIFIERS,
    verifier_label,
)
from qstream.tablefit import Cell, Table


def sensitivity_table(rs: ResultsSet, regime: str) -> Table:
    """The cumulative steps (least harmful kind first) with each kind's cost alone beside."""
    sens = rs.sections[regime]["sensitivity"]
    d = DIGITS["ceiling"]
    alone = {e["kind"]: e for e in sens["single"]}
    rows = [
        [
            Cell("(nothing: bf16 floor)"),
            Cell(""),
            estimate(sens["floor"]["ceiling"], d),
            Cell("(floor)"),
            sci(sens["floor"]["kl_p99"]),
            Cell(""),
            Cell(""),
        ]
    ]
    for e in sens["cumulative"]:
        single = alone[e["add"]]
        rows.append(
            [
                Cell(e["add"]),
                difference(single["ceiling_gap"]),
                estimate(e["ceiling"], d),
                difference(e["ceiling_gap"]),
                sci(e["kl_p99"]),
                Cell(str(len(e["quantized_tensors"])), len(e["quantized_tensors"])),
                Cell("yes" if e["within_tolerance"] else "no"),
            ]
        )
    return Table(
        f"Regime {regime}: {sens['format']} quantized one module kind more per row, least "
        f"harmful first (harm: {sens['harm']}). 'alone' is the kind's gap when quantized "
        f"by itself; 'within' compares the cumulative gap with the tolerance of "
        f"{sens['tolerance']} tokens",
        [
            "+ module kind",
            "gap alone",
            "ceiling, greedy [95% CI]",
            "gap to bf16",
            "KL p99",
            "tensors",
            "within",
        ],
        rows,
        key=f"sensitivity_{regime}",
        align="lrrrrrl",
    )


def context_sweep_table(rs: ResultsSet, regime: str) -> Table:
    """Greedy ceiling per context-length bucket (rows) and variant (columns)."""
    sweep = rs.sections[regime]["context_sweep"]
    names = [v for v in variant_order(rs) if v in sweep["buckets"][0]["variants"]]
    rows = []
    for b in sweep["buckets"]:
        rows.append(
            [
                Cell(f"[{b['lo']}, {b['hi']})"),
                Cell(b["side"]),
                Cell(
                    f"{b['anchors']['context_length_mean']:.1f}",
                    b["anchors"]["context_length_mean"],
                ),
                *(
                    estimate(
                        b["variants"][v]["metrics"]["rollouts"]["greedy"]["ceiling"],
                        DIGITS["ceiling"],
                    )
                    for v in names
                ),
            ]
        )
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


def acceptance_verifiers(rs: ResultsSet) -> list[str]:
    """Verifiers present in some variant's results, in VERIFIERS order."""
    return [
        v
        for v in VERIFIERS
        if any(
            v in result.get("acceptance", {})
            for block in rs.regimes.values()
            for result in block.values()
        )
    ]


def acceptance_tables(rs: ResultsSet, verifier: str) -> list[Table]:
    """The acceptance by ``verifier``, one row per variant and regime: vLLM's default mode beside
    the published card's, then the other modes, then adaptive verification (the last only where
    some result simulated it)."""
    tables = [
        _modes_table(rs, verifier, HEADLINE_MODES, "headline"),
        _modes_table(rs, verifier, OTHER_MODES, "other"),
    ]
    if any(_entries(rs, verifier, mode) for mode in ADAPTIVE_MODES):
        tables.append(_adaptive_table(rs, verifier))
    return tables


OTHER_MODES = tuple(
    k for k, m in ACCEPTANCE_MODES.items() if k not in HEADLINE_MODES and not m.adaptive
)
_CAPTIONS = {
    "headline": "vLLM 0.32's default mode (greedy draft: the drafter's argmax at any "
    "temperature, a one-hot draft to the rejection sampler; token-wise verification) beside "
    "the mode a published DSpark card reports (probabilistic draft, block verification)",
    "other": "the other modes: greedy draft under block verification (the same law as "
    "token-wise for a one-hot draft), probabilistic draft under token-wise verification, and a "
    "greedy verifier (temperature 0)",
}


def _acceptance_regimes(rs: ResultsSet, verifier: str) -> list[str]:
    return [
        r
        for r in regime_order(rs)
        if any(verifier in res.get("acceptance", {}) for res in rs.regimes[r].values())
    ]


def _entries(rs: ResultsSet, verifier: str, mode: str) -> list[dict]:
    """Every result's entry of ``mode`` under ``verifier``."""
    return [
        acc[mode]
        for block in rs.regimes.values()
        for res in block.values()
        if mode in (acc := res.get("acceptance", {}).get(verifier) or {})
    ]


def _acceptance_rows(
    rs: ResultsSet, verifier: str, modes: tuple[str, ...], cells
) -> list[list[Cell]]:
    """One row per mode, regime and variant (in that order, so that a mode's variants sit
    together); ``cells(acc, mode)`` the value cells from a variant's ``acceptance.VERIFIER``
    block (None: not evaluated)."""
    rows = []
    for mode in modes:
        for regime in _acceptance_regimes(rs, verifier):
            for variant in variant_order(rs):
                res = rs.regimes[regime].get(variant) or {}
                acc = res.get("acceptance", {}).get(verifier)
                rows.append(
                    [
                        Cell(ACCEPTANCE_MODES[mode].label),
                        Cell(regime),
                        Cell(variant_label(rs, variant)),
                        *cells(acc, mode),
                    ]
                )
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


_COLUMNS = ["mode", "regime", "variant", "tokens/step [95% CI]", "loss vs bf16"]


def _modes_table(rs: ResultsSet, verifier: str, modes: tuple[str, ...], which: str) -> Table:
    return Table(
        f"Expected tokens per verification step, verified by {VERIFIERS[verifier]}: "
        f"{_CAPTIONS[which]}. Accepted drafted tokens plus the resampled or bonus token "
        f"(1..{rs.block_size + 1}); a probabilistic drafter samples its full tempered softmax, "
        f"a sampling verifier is at {_verifier_sampling(rs)}; loss vs bf16 is the results' "
        "paired per-block difference",
        _COLUMNS,
        _acceptance_rows(rs, verifier, modes, _emitted_and_loss),
        key=f"acceptance_{verifier}" + ("" if which == "headline" else f"_{which}"),
        align="lll" + "r" * (len(_COLUMNS) - 3),
    )


def _adaptive_table(rs: ResultsSet, verifier: str) -> Table:
    """Each adaptive mode's expected tokens and loss, the drafted tokens it verifies, and what
    vLLM's budget rule expects from the confidence head."""
    d = DIGITS["ceiling"]

    def cells(acc: dict | None, mode: str) -> list[Cell]:
        entry = (acc or {}).get(mode)
        estimated = Cell("n/a") if entry is None else estimate(entry["estimated_emitted"], d)
        return [*_emitted_and_loss(acc, mode), estimated]

    columns = [*_COLUMNS, "vLLM's estimate [95% CI]"]
    return Table(
        f"Adaptive verification (vLLM 0.32's enable_adaptive_verification), verified by "
        f"{VERIFIERS[verifier]}: {_adaptive_setting(rs, verifier)}; each request keeps the "
        "drafted positions that rank in the batch's budget by the running product of its "
        "confidence scores, as vLLM ranks them. Tokens per step as above; vLLM's estimate is "
        "what its budget rule expects a block to emit (1 + the survival of its verified "
        "positions), the confidence head's prediction of the target's acceptance. vLLM sizes "
        "the budget from step costs it profiles on its GPU; here it is a setting "
        "(docs/acceptance.md)",
        columns,
        _acceptance_rows(rs, verifier, ADAPTIVE_MODES, cells),
        key=f"acceptance_{verifier}_adaptive",
        align="lll" + "r" * (len(columns) - 3),
    )


def _adaptive_setting(rs: ResultsSet, verifier: str) -> str:
    """The adaptive budget the results ran with, in words (every distinct one)."""
    settings = {
        (a["requests"], a["budget_share"])
        for mode in ADAPTIVE_MODES
        for entry in _entries(rs, verifier, mode)
        if (a := entry["mode"].get("adaptive"))
    }
    return "; ".join(
        f"blocks verified {r} at a time as one batch's requests, whose budget is {share:g} of "
        "their drafted tokens"
        for r, share in sorted(settings)
    )


def _verifier_sampling(rs: ResultsSet) -> str:
    return per_regime(rs, regime_order(rs), lambda r: verifier_label(r.get("sampling")))
