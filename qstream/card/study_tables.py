"""The card's tables of the optional studies: per-module sensitivity, the context-length sweep
and simulated acceptance under vLLM's verification rules (docs/card.md).  Cells and orderings
come from :mod:`qstream.card.tables`."""

from __future__ import annotations

from qstream.card.document import Cell, Table
from qstream.card.results import ResultsSet
from qstream.card.tables import (
    DIGITS,
    estimate,
    label,
    per_regime,
    regime_order,
    sci,
    variant_label,
    variant_order,
)
from qstream.eval.vocabulary import ACCEPTANCE_MODES, VERIFIERS, verifier_label


def sensitivity_table(rs: ResultsSet, regime: str) -> Table:
    """The cumulative steps (least harmful kind first) with each kind's cost alone beside."""
    sens = rs.sections[regime]["sensitivity"]
    d = DIGITS["ceiling"]
    alone = {e["kind"]: e for e in sens["single"]}
    rows = [
        [
            label("(nothing: bf16 floor)"),
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
                label(e["add"]),
                Cell(f"{single['ceiling_gap']:+.{d}f}", single["ceiling_gap"]),
                estimate(e["ceiling"], d),
                Cell(f"{e['ceiling_gap']:+.{d}f}", e["ceiling_gap"]),
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
                label(f"[{b['lo']}, {b['hi']})"),
                label(b["side"]),
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


def acceptance_table(rs: ResultsSet, verifier: str) -> Table:
    """Expected tokens per block (≤ B+1) by rule, one row per variant and regime (a column per
    regime would be 6 columns per regime wide), with the 95% CI and the results' paired loss
    against bf16."""
    d = DIGITS["ceiling"]
    regimes = [
        r
        for r in regime_order(rs)
        if any(verifier in res.get("acceptance", {}) for res in rs.regimes[r].values())
    ]
    columns = ["variant", "regime"]
    columns += [f"{name} [95% CI]" for name in ACCEPTANCE_MODES.values()]
    columns += [f"{name} loss vs bf16" for name in ACCEPTANCE_MODES.values()]
    rows = []
    for variant in variant_order(rs):
        for regime in regimes:
            row = [label(variant_label(rs, variant)), Cell(regime)]
            acc = (rs.regimes[regime].get(variant) or {}).get("acceptance", {}).get(verifier)
            if acc is None:
                row += [Cell("not evaluated")] * (2 * len(ACCEPTANCE_MODES))
            else:
                row += [estimate(acc[mode]["emitted"], d) for mode in ACCEPTANCE_MODES]
                loss = acc.get("loss_vs_bf16")
                row += [
                    Cell("(floor)") if loss is None else estimate(loss[mode], d)
                    for mode in ACCEPTANCE_MODES
                ]
            rows.append(row)
    return Table(
        f"Expected tokens per verification step, verified by {VERIFIERS[verifier]}: "
        f"accepted drafted tokens plus the resampled or bonus token (1..{rs.block_size + 1}), "
        "token-wise rejection sampling and block verification with the drafter on the "
        f"full tempered softmax and the verifier at {_verifier_sampling(rs)}, and greedy; "
        "loss vs bf16 is the results' paired per-block difference",
        columns,
        rows,
        key=f"acceptance_{verifier}",
        align="ll" + "r" * (len(columns) - 2),
    )


def _verifier_sampling(rs: ResultsSet) -> str:
    return per_regime(rs, regime_order(rs), lambda r: verifier_label(r.get("sampling")))
