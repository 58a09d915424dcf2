"""The words of the card's figures: the names of the quantities on their axes, their legends'
special entries and the captions the card prints under them (docs/card.md, "Figures").

Kept apart from the drawing (qstream/card/figures.py) and built from the same results, so that
tests/test_card_figures.py can hold each caption against the data the figure plots.
"""

from __future__ import annotations

from qstream.card.results import ResultsSet
from qstream.card.tables import metrics, regime_order, variant_order

# The per-position quantities of the rollouts (docs/eval-drift.md), a row each in seq_agree.png:
# results key -> the y axis's words.  Both count every block; seq agree asks about token k alone,
# so rollouts that parted earlier and draw the same token again count as agreeing there, while
# prefix agree asks for tokens 1..k all equal, the run a verifier accepts, and only falls with k.
POSITION_QUANTITIES = {
    "seq_agree": "seq agree[k]: token k equal\n(share of all blocks)",
    "prefix_agree": "prefix agree[k]: tokens 1..k equal\n(share of all blocks)",
}

SEQ_AGREE_CAPTION = (
    "Free-running rollouts by drafted position: two rows per rollout mode, one column per "
    "regime, one line per format with its 95% band. The upper row of each pair is seq "
    "agree[k], the share of all blocks whose two rollouts draw the same token at position k: a "
    "block whose rollouts parted earlier counts again wherever they draw the same token, so this "
    "curve can rise with k. The lower row is prefix agree[k], the share of all blocks whose "
    "tokens 1..k all match: the run a verifier accepts, where drift compounds, so it can only "
    "fall with k (its sum over k is the mean matched prefix). Lines that coincide are equal "
    "results (e.g. a checkpoint read back from disk and the same format simulated): the legend "
    "says which, and the later one's open markers ring the other's."
)


def coinciding(rs: ResultsSet, rows: list[tuple[str, str]]) -> dict[str, str]:
    """Each variant whose seq_agree.png lines (``rows``: rollout mode, quantity) equal an
    earlier variant's in every regime -> the first such variant, whose line would hide it."""

    def curves(v: str) -> list:
        return [
            ((metrics(rs, r, v) or {}).get("rollouts", {}).get(mode) or {}).get(quantity)
            for r in regime_order(rs)
            for mode, quantity in rows
        ]

    firsts: list[tuple[str, list]] = []
    twins = {}
    for v in variant_order(rs):
        mine = curves(v)
        twin = next((u for u, theirs in firsts if theirs == mine), None)
        if twin is None:
            firsts.append((v, mine))
        else:
            twins[v] = twin
    return twins


CEILING_CAPTION = (
    "Greedy acceptance ceiling (left) and sampled matched prefix, a lower bound (right), by "
    "format (bars) and regime (groups), 95% CI error bars."
)

CONTEXT_CAPTION = (
    "Greedy acceptance ceiling per context-length bucket (x: the bucket's mean context), one line "
    "per format, 95% bands; the dotted line is the YaRN boundary."
)

# KL percentiles of the results (llama.cpp's report), drawn as a ladder on kl.png's log axis:
# (results key, legend name, marker).
KL_LADDER = (
    ("median", "median", "o"),
    ("p90", "p90", "s"),
    ("p95", "p95", "^"),
    ("p99", "p99", "D"),
    ("p99_9", "p99.9", "v"),
    ("max", "max", "x"),
)
KL_MEAN_LEGEND = "mean, 95% CI (±: its half-width, % of the mean)"


def kl_star(kl: dict) -> dict | None:
    """The mean KL estimate kl.png draws as a star, or None: on a log axis only a positive mean
    of a variant with some positive percentile is drawn (zero KL is labelled instead)."""
    mean = kl["mean"]
    positive = any((kl.get(key) or 0) > 0 for key, _, _ in KL_LADDER)
    if not positive or mean.get("value") is None or mean["value"] <= 0:
        return None
    return mean


def ci_half_width(e: dict) -> float | None:
    """The half-width of an estimate's interval in percent of its value, the larger side; None
    when the results hold no interval."""
    if e.get("lo") is None or e.get("hi") is None:
        return None
    return 100 * max(e["value"] - e["lo"], e["hi"] - e["value"]) / e["value"]


def ci_percent(e: dict) -> str:
    """The label kl.png writes beside a mean: ``±2.4%``, or ``no CI``."""
    half = ci_half_width(e)
    if half is None:
        return "no CI"
    return f"±{half:.1f}%"


def kl_caption(rs: ResultsSet) -> str:
    """kl.png's caption, with the range of the interval labels it draws."""
    stars = [
        star
        for r in regime_order(rs)
        for v in variant_order(rs)
        if (m := metrics(rs, r, v)) is not None and (star := kl_star(m["kl"])) is not None
    ]
    widths = sorted((h, ci_percent(s)) for s in stars if (h := ci_half_width(s)) is not None)
    here = f" (here from {widths[0][1]} to {widths[-1][1]})" if widths else ""
    return (
        "KL(ref‖var) per drafted token on a log axis: each marker is a percentile from the "
        "results (median, p90, p95, p99, p99.9, max), the star the mean with its 95% CI as an "
        "error bar. An interval a few percent wide is hidden by the star on a log axis, so each "
        f"star is labelled with its CI's half-width in percent of the mean{here}. Percentiles, "
        "not raw samples."
    )
