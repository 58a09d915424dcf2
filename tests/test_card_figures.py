"""The card's figures say what they show: each figure is drawn (matplotlib's Agg renderer) from a
real results file, its plotted artists are read back and held against the JSON, and its axis
labels and the caption the card prints under it against those plotted numbers.  The
sensitivity section names the format and the tolerance it judged by.

Panels carry a gid naming what they plot (``regime/mode/quantity`` in seq_agree.png, the regime
in kl.png, the rollout mode in ceiling.png); lines, bands, error bars and labels carry their
variant (qstream/card/figures.py)."""

import json
import re
from pathlib import Path

import pytest
from matplotlib.container import BarContainer

from qstream.card.build import build_card
from qstream.card.document import Figure
from qstream.card.figures import (
    calibration_figure,
    ceiling_figure,
    kl_figure,
    seq_agree_figure,
)
from qstream.card.measured import read_speculate
from qstream.card.results import merge_results
from qstream.card.tables import rollout_name
from qstream.eval.vocabulary import PREFIX_KEYS, ROLLOUT_MODES

ROOT = Path(__file__).parent.parent
SMALL = ROOT / "tests" / "data" / "card_results.json"
FULL = ROOT / "examples" / "card_tiny" / "results.json"
KL_PERCENTILES = ("median", "p90", "p95", "p99", "p99_9", "max")


@pytest.fixture(scope="module")
def data() -> dict:
    return json.loads(SMALL.read_text())


@pytest.fixture(scope="module")
def rs():
    return merge_results([SMALL])


@pytest.fixture(scope="module")
def captions(rs) -> dict[str, str]:
    """The caption the card prints under each figure, by file name."""
    card = build_card(rs, figures_dir="F")
    return {
        Path(p.path).name: p.caption
        for s in card.sections
        for p in s.parts
        if isinstance(p, Figure)
    }


def _metrics(data: dict, regime: str, variant: str) -> dict:
    return data["regimes"][regime]["variants"][variant]["metrics"]


def _panels(fig) -> dict:
    return {ax.get_gid(): ax for ax in fig.axes if ax.get_gid()}


def _sentence_with(text: str, word: str) -> str:
    return next((s for s in re.split(r"(?<=\.) ", text) if word in s), "")


@pytest.fixture(scope="module")
def seq_panels(rs, tmp_path_factory) -> dict:
    return _panels(seq_agree_figure(rs, tmp_path_factory.mktemp("fig") / "seq_agree.png"))


def test_seq_agree_figure_plots_seq_and_prefix_agree_of_every_variant(seq_panels, data, rs):
    regimes = list(data["regimes"])
    quantities = ("seq_agree", "prefix_agree")
    assert set(seq_panels) == {
        f"{r}/{m}/{q}" for r in regimes for m in ROLLOUT_MODES for q in quantities
    }
    B = data["block_size"]
    for gid, ax in seq_panels.items():
        regime, mode, quantity = gid.split("/")
        assert ax.get_title() == f"{regime} — {rollout_name(rs, mode, [regime])}"
        lines = {line.get_label(): line for line in ax.get_lines()}
        bands = {band.get_gid(): band for band in ax.collections}
        assert set(lines) == set(bands) == set(data["regimes"][regime]["variants"])
        for variant, line in lines.items():
            per_k = _metrics(data, regime, variant)["rollouts"][mode][quantity]
            assert list(line.get_xdata()) == list(range(1, B + 1))
            assert list(line.get_ydata()) == [e["value"] for e in per_k]
            band_y = set(bands[variant].get_paths()[0].vertices[:, 1].tolist())
            assert {e["lo"] for e in per_k} | {e["hi"] for e in per_k} <= band_y


def test_seq_agree_axes_name_the_quantity_plotted(seq_panels):
    """Each row's y axis says which quantity it is, over which blocks: token k alone, or
    tokens 1..k, always a share of all blocks (not of the blocks still matched)."""
    words = {"seq_agree": "token k equal", "prefix_agree": "tokens 1..k equal"}
    for gid, ax in seq_panels.items():
        regime, _, quantity = gid.split("/")
        if ax.get_ylabel():  # the first column labels the row's shared axis
            assert words[quantity] in ax.get_ylabel(), gid
            assert "share of all blocks" in ax.get_ylabel(), gid
    labelled = {gid.split("/", 1)[1] for gid, ax in seq_panels.items() if ax.get_ylabel()}
    assert labelled == {gid.split("/", 1)[1] for gid in seq_panels}, "every row is labelled"


def test_seq_agree_caption_holds_for_the_plotted_lines(seq_panels, captions, data):
    """The caption puts the compounding in prefix agree, which can only fall with k and sums to
    the mean matched prefix; seq agree is described per position, where it may rise."""
    caption = captions["seq_agree.png"]
    assert "prefix agree" in _sentence_with(caption, "compounds")
    assert "seq agree" not in _sentence_with(caption, "compounds")
    assert "rise" in _sentence_with(caption, "same token at position k")
    for gid, ax in seq_panels.items():
        regime, mode, quantity = gid.split("/")
        if quantity != "prefix_agree":
            continue
        for line in ax.get_lines():
            y = list(line.get_ydata())
            assert y == sorted(y, reverse=True), f"{gid} {line.get_label()} rises"
            prefix = _metrics(data, regime, line.get_label())["rollouts"][mode]
            assert sum(y) == pytest.approx(prefix[PREFIX_KEYS[mode]]["value"], abs=1e-12)


def test_kl_figure_draws_each_mean_with_its_interval_and_labels_its_width(
    rs, data, captions, tmp_path
):
    fig = kl_figure(rs, tmp_path / "kl.png")
    panels = _panels(fig)
    assert set(panels) == set(data["regimes"])
    shown = []
    for regime, ax in panels.items():
        ladders = {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}
        bars = {bar.get_label(): bar for bar in ax.containers}
        labels = {text.get_gid(): text.get_text() for text in ax.texts}
        for variant in data["regimes"][regime]["variants"]:
            kl = _metrics(data, regime, variant)["kl"]
            assert list(ladders[variant].get_ydata()) == [kl[k] for k in KL_PERCENTILES]
            mean = kl["mean"]
            data_line, _, (interval,) = bars[variant].lines
            assert list(data_line.get_ydata()) == [mean["value"]]
            (segment,) = interval.get_segments()
            assert sorted(segment[:, 1]) == pytest.approx([mean["lo"], mean["hi"]], rel=1e-12)
            half = 100 * max(mean["value"] - mean["lo"], mean["hi"] - mean["value"]) / mean["value"]
            assert labels[variant] == f"±{half:.1f}%"
            shown.append((half, labels[variant]))
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any("95% CI" in t and "±" in t for t in legend)
    caption = captions["kl.png"]
    assert "95% CI as an error bar" in caption
    assert f"(here from {min(shown)[1]} to {max(shown)[1]})" in caption


def test_ceiling_figure_bars_are_the_ceilings_with_their_intervals(rs, data, tmp_path):
    panels = _panels(ceiling_figure(rs, tmp_path / "ceiling.png"))
    assert set(panels) == set(ROLLOUT_MODES)
    for mode, ax in panels.items():
        assert ax.get_ylim() == (0, data["block_size"])
        for bars in (c for c in ax.containers if isinstance(c, BarContainer)):
            estimates = [
                _metrics(data, r, bars.get_label())["rollouts"][mode][PREFIX_KEYS[mode]]
                for r in data["regimes"]
            ]
            assert [p.get_height() for p in bars.patches] == [e["value"] for e in estimates]
            ys = [sorted(s[:, 1]) for s in bars.errorbar.lines[2][0].get_segments()]
            assert ys == [pytest.approx([e["lo"], e["hi"]]) for e in estimates]


def test_sensitivity_without_a_suggestion_names_format_tolerance_and_gentlest_kind():
    rs = merge_results([FULL])
    card = build_card(rs, figures_dir=None)
    (section,) = [s for s in card.sections if s.title == "Which modules may be quantized"]
    for regime in rs.regimes:
        sens = rs.sections[regime]["sensitivity"]
        assert sens["suggested"]["command"] is None  # the example suggests nothing
        (text,) = [
            p for p in section.parts if isinstance(p, str) and p.startswith(f"Regime {regime}:")
        ]
        gentlest = max(sens["single"], key=lambda e: e["ceiling_gap"])
        assert f"quantized to {sens['format']}" in text
        assert f"tolerance of {sens['tolerance']} tokens" in text
        assert f"{gentlest['kind']}, lowers it by {-gentlest['ceiling_gap']:.3f} tokens" in text


def _coinciding(data: dict) -> dict[str, str]:
    """Each variant whose rollout curves equal an earlier variant's in every regime -> the
    first such variant."""
    names = list(data["variants"])

    def curves(v):
        return [
            {m: (r[m]["seq_agree"], r[m]["prefix_agree"]) for m in r}
            for regime in data["regimes"].values()
            for r in [regime["variants"][v]["metrics"]["rollouts"]]
        ]

    firsts = [v for i, v in enumerate(names) if all(curves(u) != curves(v) for u in names[:i])]
    return {v: next(u for u in firsts if curves(u) == curves(v)) for v in names if v not in firsts}


def test_seq_agree_legend_names_lines_that_coincide_and_draws_them_apart(rs, data, tmp_path):
    """A line exactly under another (a checkpoint read back and the same format simulated) is
    named in the legend as coinciding, and drawn with hollow, larger markers so that both show."""
    fig = seq_agree_figure(rs, tmp_path / "seq_agree.png")
    twins = _coinciding(data)
    assert twins == {"shipped-fp8": "fp8"}  # the data this test rests on
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [
        f"{v} (same as {twins[v]}: the lines coincide)" if v in twins else v
        for v in data["variants"]
    ]
    for gid, ax in _panels(fig).items():
        lines = {line.get_label(): line for line in ax.get_lines()}
        for v, u in twins.items():
            assert lines[v].get_markerfacecolor() == "none", gid
            assert lines[v].get_markersize() > lines[u].get_markersize() + 2, gid
            assert lines[u].get_markerfacecolor() != "none", gid


PAIR = ROOT / "examples" / "card_gsm8k_pair"


def _calibration(tmp_path: Path, results: list[str], keep: tuple[str, ...] | None = None):
    rs = merge_results([PAIR / name for name in results])
    spec = read_speculate(PAIR / "speculate.json", rs)
    if keep is not None:
        spec["variants"] = {k: v for k, v in spec["variants"].items() if k in keep}
    return calibration_figure(spec, rs, tmp_path / "calibration.png")


def _series(fig) -> dict:
    """Each error-bar series of calibration.png: label -> (xs, ys, the bars' ends)."""
    out = {}
    for c in fig.axes[0].containers:
        line, _, bars = c.lines
        ends = [y for col in bars for seg in col.get_segments() for _, y in seg]
        out[c.get_label()] = (list(line.get_xdata()), list(line.get_ydata()), ends)
    return out


def test_calibration_legend_lists_only_series_with_points(tmp_path):
    """Without the states regime nothing is simulated: no legend entry for it."""
    fig = _calibration(tmp_path, ["results-synthetic.json"], ("bf16", "nvfp4"))
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [label for label, (xs, _, _) in _series(fig).items() if xs]
    assert legend == ["measured (target in the loop)"] + [
        f"ceiling loss, {g}" for g in ("gauss", "heavy", "boot")
    ]


@pytest.mark.parametrize(
    "results, keep",
    [(["results-synthetic.json"], ("bf16", "nvfp4")),
     (["results-synthetic.json", "results-states.json"], None)],
)  # fmt: skip
def test_calibration_axes_hold_every_point_with_a_margin(tmp_path, results, keep):
    """No marker at the edge: every point and error-bar end is inside the axes by at least 5%
    of the y span, and a tenth of a variant's slot (x: one unit per variant)."""
    fig = _calibration(tmp_path, results, keep)
    ax = fig.axes[0]
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    mx, my = 0.1, 0.05 * (y1 - y0)
    for label, (xs, ys, ends) in _series(fig).items():
        assert all(x0 + mx <= x <= x1 - mx for x in xs), (label, xs, (x0, x1))
        assert all(y0 + my <= y <= y1 - my for y in ys + ends), (label, ys, (y0, y1))
