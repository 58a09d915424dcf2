"""The card's figures (PNG, matplotlib's Agg backend) from the results JSON and, for
calibration.png, `qstream speculate`'s (docs/card.md, "Figures"): opaque white background, the
Okabe–Ito palette ("Color Universal Design", 2008) without its yellow, and per variant its own
line style and marker, for greyscale printing."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qstream.card.measured import calibration_rows, speculate_mode
from qstream.card.results import ResultsSet
from qstream.card.tables import metrics, regime_order, rollout_name, variant_order
from qstream.eval.vocabulary import FLOOR, PREFIX_KEYS, PREFIX_LABELS, ROLLOUT_MODES

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 150
BACKGROUND = "white"
# Okabe–Ito: black, blue, vermillion, bluish green, reddish purple, orange, sky blue.
PALETTE = ("#000000", "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9")
LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 2)))
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
LADDER_STEP = 0.07  # x offset between consecutive percentiles of one variant


# The rollouts' per-position quantities (docs/eval-drift.md), a row each in seq_agree.png: results
# key -> the y axis's words.  tests/test_card_figures.py holds each caption against the data.
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
    """Each variant whose seq_agree.png lines (``rows``: mode, quantity) equal an earlier
    variant's in every regime -> the first such variant."""

    def curves(v: str) -> list:
        return [
            ((metrics(rs, r, v) or {}).get("rollouts", {}).get(mode) or {}).get(quantity)
            for r in regime_order(rs)
            for mode, quantity in rows
        ]

    lines = {v: curves(v) for v in variant_order(rs)}
    first = {v: next(u for u in lines if lines[u] == mine) for v, mine in lines.items()}
    return {v: u for v, u in first.items() if u != v}


CEILING_CAPTION = (
    "Greedy acceptance ceiling (left) and sampled matched prefix, a lower bound (right), by "
    "format (bars) and regime (groups), 95% CI error bars."
)

CONTEXT_CAPTION = (
    "Greedy acceptance ceiling per context-length bucket (x: the bucket's mean context), one line "
    "per format, 95% bands; the dotted line is the YaRN boundary."
)

# KL percentiles (llama.cpp's report) on kl.png's log axis: (results key, legend name, marker).
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
    """The larger half of an estimate's interval in percent of its value."""
    if e.get("lo") is None or e.get("hi") is None:
        return None
    return 100 * max(e["value"] - e["lo"], e["hi"] - e["value"]) / e["value"]


def ci_percent(e: dict) -> str:
    """The label kl.png writes beside a mean: ``±2.4%``, or ``no CI``."""
    half = ci_half_width(e)
    return "no CI" if half is None else f"±{half:.1f}%"


def kl_caption(rs: ResultsSet) -> str:
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


def _style(index: int) -> dict:
    return {
        "color": PALETTE[index % len(PALETTE)],
        "linestyle": LINESTYLES[index % len(LINESTYLES)],
        "marker": MARKERS[index % len(MARKERS)],
    }


def _new_figure(n_rows: int, n_cols: int, panel: tuple[float, float], sharey=False):
    from matplotlib.figure import Figure

    fig = Figure(
        figsize=(panel[0] * n_cols, panel[1] * n_rows + 0.9),
        dpi=DPI,
        facecolor=BACKGROUND,
        layout="constrained",
    )
    axes = fig.subplots(n_rows, n_cols, squeeze=False, sharey=sharey)
    for ax in axes.flat:
        ax.set_facecolor(BACKGROUND)
        ax.grid(True, color="#d9d9d9", linewidth=0.6)
        ax.set_axisbelow(True)
    return fig, axes


def _save(fig: Figure, path: Path, title: str, handles, labels=None) -> Figure:
    """``fig`` titled, its legend below (``handles`` a dict: its keys the labels), saved."""
    if isinstance(handles, dict):
        handles, labels = list(handles.values()), labels or list(handles)
    fig.suptitle(title, fontsize=11)
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 8), frameon=False)
    fig.savefig(path, facecolor=BACKGROUND, transparent=False)
    return fig


def seq_agree_figure(rs: ResultsSet, path: Path) -> Figure:
    """seq agree[k] and prefix agree[k] with 95% bands; panel gids ``regime/mode/quantity``."""
    regimes, variants = regime_order(rs), variant_order(rs)
    present = {
        m for r in regimes for v in variants for m in (metrics(rs, r, v) or {}).get("rollouts", {})
    }
    modes = [m for m in ROLLOUT_MODES if m in present]
    rows = [(mode, quantity) for mode in modes for quantity in POSITION_QUANTITIES]
    twins = coinciding(rs, rows)  # drawn hollow over their twin's line, and said so
    fig, axes = _new_figure(len(rows), len(regimes), (4.2, 3.2), sharey="row")
    positions = list(range(1, rs.block_size + 1))
    handles: dict[str, Any] = {}
    for row, (mode, quantity) in enumerate(rows):
        lowest = 1.0  # the row shares one y scale, so it must span every panel's bands
        for col, regime in enumerate(regimes):
            ax = axes[row][col]
            ax.set_gid(f"{regime}/{mode}/{quantity}")
            for i, variant in enumerate(variants):
                m = metrics(rs, regime, variant)
                if m is None or mode not in m["rollouts"]:
                    continue
                per_k = m["rollouts"][mode][quantity]
                line, lo = _line_with_band(
                    ax, positions, per_k, variant, i, hollow=variant in twins
                )
                handles.setdefault(variant, line)
                lowest = min(lowest, *lo)
            ax.set_title(f"{regime} — {rollout_name(rs, mode, [regime])}", fontsize=9)
            ax.set_xlabel("drafted position k")
            if col == 0:  # the row shares its y axis
                ax.set_ylabel(POSITION_QUANTITIES[quantity])
            ax.set_xticks(range(1, rs.block_size + 1))
        axes[row][0].set_ylim(max(0.0, lowest - 0.03), 1.01)
    labels = [f"{v} (same as {twins[v]}: the lines coincide)" if v in twins else v for v in handles]
    title = "Free-running rollouts against the FP32 reference by drafted position (bands: 95% CI)"
    return _save(fig, path, title, handles, labels)


def _errors(estimates: list[dict]) -> list[list[float]]:
    """The error bars' lengths below and above each estimate (0 where a bound is null)."""
    below = [e["value"] - e["lo"] if e.get("lo") is not None else 0.0 for e in estimates]
    return [below, [e["hi"] - e["value"] if e.get("hi") is not None else 0.0 for e in estimates]]


def _line_with_band(ax, xs: list, estimates: list[dict], variant: str, i: int, hollow=False):
    """The ``i``-th variant's line with a band (gid ``variant``); the line and lower bounds."""
    style = {"markersize": 4, "linewidth": 1.5, **_style(i)}
    if hollow:
        style |= {"markersize": 8, "markerfacecolor": "none", "markeredgewidth": 1.3}
    values = [e["value"] for e in estimates]
    (line,) = ax.plot(xs, values, label=variant, **style)
    lo = [e["lo"] if e["lo"] is not None else e["value"] for e in estimates]
    hi = [e["hi"] if e["hi"] is not None else e["value"] for e in estimates]
    band = ax.fill_between(xs, lo, hi, color=style["color"], alpha=0.15, linewidth=0)
    band.set_gid(variant)
    return line, lo


def ceiling_figure(rs: ResultsSet, path: Path) -> Figure:
    """Mean matched prefix by regime (groups) and variant (bars); panel gids: rollout modes."""
    from matplotlib.patheffects import withStroke

    regimes, variants = regime_order(rs), variant_order(rs)
    fig, axes = _new_figure(1, len(ROLLOUT_MODES), (max(4.2, 1.3 * len(regimes) + 1.5), 3.6))
    width = 0.8 / max(len(variants), 1)
    handles: dict[str, Any] = {}
    for col, mode in enumerate(ROLLOUT_MODES):
        ax = axes[0][col]
        ax.set_gid(mode)
        for i, variant in enumerate(variants):
            points = [
                (g - 0.4 + width * (i + 0.5), m["rollouts"][mode][PREFIX_KEYS[mode]])
                for g, regime in enumerate(regimes)
                if (m := metrics(rs, regime, variant)) is not None and mode in m["rollouts"]
            ]
            xs, values = [x for x, _ in points], [e["value"] for _, e in points]
            errs = _errors([e for _, e in points])
            style = _style(i)
            hatch = None if variant == FLOOR else ("", "//", "..", "xx", "\\\\")[i % 5]
            error_kw = {"ecolor": "black", "elinewidth": 1.2}
            bars = ax.bar(xs, values, width * 0.92, yerr=errs, capsize=2, color=style["color"],
                          edgecolor="black", linewidth=0.5, hatch=hatch, error_kw=error_kw,
                          label=variant)  # fmt: skip
            # a white halo keeps the error bar visible over a dark (e.g. black bf16) bar
            for line in bars.errorbar.lines[1] + bars.errorbar.lines[2]:
                line.set_path_effects([withStroke(linewidth=3, foreground="white")])
            handles.setdefault(variant, bars)
        ax.set_xticks(range(len(regimes)), regimes)
        ax.set_xlabel("aux regime")
        ax.set_ylabel(f"mean matched prefix (tokens, 0..{rs.block_size})")
        ax.set_ylim(0, rs.block_size)
        ax.set_title(f"{PREFIX_LABELS[mode]}\n{rollout_name(rs, mode)}", fontsize=9)
    return _save(
        fig, path, "Greedy ceiling and sampled matched prefix (error bars: 95% CI)", handles
    )


def kl_figure(rs: ResultsSet, path: Path) -> Figure:
    """KL(ref‖var) per drafted token as a percentile ladder on a log axis, a panel per regime
    (gid: the regime), the mean a star labelled :func:`ci_percent`; zero KL is labelled instead.
    The ladder line, the mean's error bar and its label carry the variant (gid, label, gid)."""
    from matplotlib.lines import Line2D

    regimes, variants = regime_order(rs), variant_order(rs)
    fig, axes = _new_figure(
        1, len(regimes), (max(3.6, 0.7 * len(variants) + 1.0), 3.8), sharey=True
    )
    for col, regime in enumerate(regimes):
        ax = axes[0][col]
        ax.set_gid(regime)
        ax.set_yscale("log")
        for i, variant in enumerate(variants):
            m = metrics(rs, regime, variant)
            if m is None:
                continue
            _kl_variant(ax, i, m["kl"], variant)
        ax.set_xticks(range(len(variants)), variants, rotation=30 if len(variants) > 4 else 0)
        ax.set_xlim(-0.8, len(variants) - 0.4)  # room for the first star's label
        ax.set_xlabel("variant")
        if col == 0:  # panels share the y axis
            ax.set_ylabel("KL(ref‖var) per token (nats, log scale)")
        ax.set_title(regime, fontsize=9)
    grey = "#555555"
    handles = [
        Line2D([], [], color=grey, marker=mk, linestyle="none", label=name)
        for _, name, mk in KL_LADDER
    ]
    handles.append(
        Line2D([], [], color=grey, marker="*", markersize=9, linestyle="-", label=KL_MEAN_LEGEND)
    )
    title = "KL divergence per drafted token: reported percentiles (not a density)"
    return _save(fig, path, title, handles, [h.get_label() for h in handles])


def _kl_variant(ax, x: int, kl: dict, variant: str) -> None:
    """One variant's percentiles (or a "KL = 0" label when none is above zero) and its
    :func:`kl_star` mean, its 95% CI (above zero) an error bar, labelled :func:`ci_percent`."""
    color = _style(x)["color"]
    points = [(kl[key], mk) for key, _, mk in KL_LADDER if kl.get(key) is not None and kl[key] > 0]
    if not points:
        ax.annotate("KL = 0", (x, 0.02), xycoords=("data", "axes fraction"), ha="center",
                    fontsize=8, color=color)  # fmt: skip
        return
    # a staircase, so that close percentiles do not hide each other's markers on the log axis
    xs = [x - 0.1 + LADDER_STEP * j for j in range(len(points))]
    (ladder,) = ax.plot(xs, [y for y, _ in points], color=color, linewidth=1.0)
    ladder.set_gid(variant)
    for xj, (y, mk) in zip(xs, points):
        ax.plot([xj], [y], marker=mk, color=color, linestyle="none", markersize=5)
    if (mean := kl_star(kl)) is None:
        return
    value, lo, hi = mean["value"], mean.get("lo"), mean.get("hi")
    yerr = None if lo is None or hi is None else [[value - max(lo, 0.0)], [hi - value]]
    bar = ax.errorbar([x - 0.25], [value], yerr=yerr, color=color, marker="*", markersize=8,
                      capsize=2, linestyle="none")  # fmt: skip
    bar.set_label(variant)
    ax.annotate(ci_percent(mean), (x - 0.25, value), xytext=(-6, 0), textcoords="offset points",
                ha="right", va="center", fontsize=6.5, color=color, gid=variant)  # fmt: skip


def sweep_regimes(rs: ResultsSet) -> list[str]:
    """Regimes whose results hold a long-context sweep."""
    return [r for r in regime_order(rs) if "context_sweep" in rs.sections.get(r, {})]


def context_figure(rs: ResultsSet, path: Path) -> Figure:
    """Greedy ceiling against context length (each bucket at its mean), a panel per regime."""
    regimes = sweep_regimes(rs)
    fig, axes = _new_figure(1, len(regimes), (5.2, 3.6), sharey=True)
    handles: dict[str, Any] = {}
    for col, regime in enumerate(regimes):
        ax, sweep = axes[0][col], rs.sections[regime]["context_sweep"]
        xs = [b["anchors"]["context_length_mean"] for b in sweep["buckets"]]
        for i, variant in enumerate(variant_order(rs)):
            if variant not in sweep["buckets"][0]["variants"]:
                continue
            est = [
                b["variants"][variant]["metrics"]["rollouts"]["greedy"]["ceiling"]
                for b in sweep["buckets"]
            ]
            line, _ = _line_with_band(ax, xs, est, variant, i)
            handles.setdefault(variant, line)
        ax.axvline(sweep["yarn_boundary"], color="#555555", linestyle=":", linewidth=1.2)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length of the block (tokens, log scale)")
        if col == 0:
            ax.set_ylabel(f"ceiling, greedy (tokens, 0..{rs.block_size})")
        ax.set_ylim(0, rs.block_size)
        ax.set_title(f"{regime} (dotted: YaRN boundary {sweep['yarn_boundary']})", fontsize=9)
    return _save(fig, path, "Acceptance ceiling by context length (bands: 95% CI)", handles)


def calibration_figure(spec: dict, rs: ResultsSet, path: Path) -> Figure:
    """Per format: the measured, simulated and each regime's ceiling loss against bf16."""
    rows = calibration_rows(spec, rs)
    names = list(rows)
    regimes = regime_order(rs)
    series = [("measured (target in the loop)", lambda r: r["measured"]),
              ("simulated (eval-drift, states)", lambda r: r["simulated"]),
              *((f"ceiling loss, {g}", lambda r, g=g: r["ceiling"][g]) for g in regimes)]  # fmt: skip
    fig, axes = _new_figure(1, 1, (max(5.0, 1.2 * len(names) + 2.5), 3.6))
    ax = axes[0][0]
    # only series with a point (e.g. no states regime: nothing simulated) get a slot and a legend
    kept = [(k, *s) for k, s in enumerate(series) if any(s[1](rows[n]) for n in names)]
    step = 0.8 / max(len(kept), 1)
    ends = [0.0]  # every point and interval end, for limits that clip no marker
    for j, (k, label, pick) in enumerate(kept):  # k: the series' own style, j: its slot
        points = [(i - 0.4 + step * (j + 0.5), e) for i, name in enumerate(names)
                  if (e := pick(rows[name])) is not None]  # fmt: skip
        xs, ys = [x for x, _ in points], [e["value"] for _, e in points]
        lo, hi = _errors([e for _, e in points])
        ends += [y + d for y, dl, dh in zip(ys, lo, hi) for d in (-dl, 0.0, dh)]
        style = _style(k)
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style["marker"], color=style["color"],
                    capsize=3, label=label)  # fmt: skip
    ax.axhline(0.0, color="black", linewidth=0.8)
    pad = 0.08 * (max(ends) - min(ends)) or 0.1
    ax.set_ylim(min(ends) - pad, max(ends) + pad)
    ax.set_xlim(-0.5, max(len(names), 1) - 0.5)  # a variant's slot is 1 wide, its points 0.8
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("tokens lost against bf16")
    ax.set_xlabel("variant")
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", frameon=False, fontsize=8)
    fig.savefig(path, facecolor=BACKGROUND, transparent=False)
    return fig


def write_figures(rs: ResultsSet, directory: Path, speculate: dict | None = None) -> list[Path]:
    """Each figure the results hold the data for, drawn into ``directory``; their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    figures = {
        "seq_agree.png": seq_agree_figure,
        "ceiling.png": ceiling_figure,
        "kl.png": kl_figure,
    }
    if sweep_regimes(rs):
        figures["context.png"] = context_figure
    if speculate is not None and speculate_mode(speculate).greedy_verifier:
        figures["calibration.png"] = partial(calibration_figure, speculate)
    for name, draw in figures.items():
        draw(rs, directory / name)
    return [directory / name for name in figures]
