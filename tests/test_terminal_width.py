"""Every table a command prints fits the terminal's width (100 columns, and 80) without splitting
a table or cutting a name short: ``formats``, ``inspect`` and eval-drift's report
(docs/guarantees.md, "Shown").  A name is shown whole: on one line, or wrapped between its words
or dotted parts, so that the cell's lines joined give it back."""

import copy
import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from qstream.card.terminal import print_report
from qstream.cli import cli
from qstream.quant import quantize_checkpoint
from qstream.tablefit import Column, fitted_table, wrap

EXAMPLES = Path(__file__).parent.parent / "examples"
WIDTHS = (100, 80)
SEPARATORS = "./-"  # a name wraps after these (qstream/tablefit.py); words wrap at a space


def _lines(text: str) -> list[str]:
    return text.splitlines()


def _assert_fits(text: str, width: int) -> None:
    widest = max(_lines(text), key=len)
    assert len(widest) <= width, f"{len(widest)} > {width} columns: {widest!r}"
    assert "…" not in text, "a cell was cut short"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.split("│")]


def _join(pieces: list[str]) -> str:
    """A wrapped cell's lines as its text: no space after a name's separator."""
    out = ""
    for piece in pieces:
        if piece:
            out += piece if not out or out[-1] in SEPARATORS else " " + piece
    return out


def rows_by_first_cell(text: str) -> list[str]:
    """The first column of every table in ``text``, one entry per row: a line whose second cell
    is blank continues the row above."""
    rows: list[list[str]] = []
    for line in _lines(text):
        cells = _cells(line)
        if len(cells) < 2:
            continue
        if cells[1] or not rows:
            rows.append([cells[0]])
        else:
            rows[-1].append(cells[0])
    return [_join(r) for r in rows]


def grouped_labels(text: str) -> list[str]:
    """The first column of every grouped table in ``text``, one entry per group: the label's
    lines spread down the group's rows (a ┼ rule or a new header ends a group)."""
    groups: list[list[str]] = [[]]
    for line in _lines(text):
        if "┼" in line or "╇" in line:
            groups.append([])
        elif "│" in line:
            groups[-1].append(_cells(line)[0])
    return [_join(g) for g in groups if any(g)]


# -- the layout engine ------------------------------------------------------------------------


def test_wrap_breaks_names_between_dotted_parts_and_keeps_ci_together():
    assert wrap("layers.*.self_attn.kv_a_proj_with_mqa.weight_scale", 20) == [
        "layers.*.self_attn.",
        "kv_a_proj_with_mqa.",
        "weight_scale",
    ]
    assert wrap("tokens/step [95% CI]", 17) == ["tokens/step", "[95% CI]"]
    assert wrap("greedy agree, all positions", 12) == ["greedy", "agree, all", "positions"]


@pytest.mark.parametrize("width", WIDTHS)
def test_a_fitted_table_wraps_labels_and_never_cuts_a_value(width):
    names = [f"layers.*.self_attn.module_{i}.weight_global_scale" for i in range(3)]
    rows = [[n, "0.993 [0.980, 0.998]", "2.25e-04 [2.02e-04, 2.49e-04]"] for n in names]
    columns = [Column("name"), Column("agree [95% CI]", right=True), Column("KL", right=True)]
    out = io.StringIO()
    Console(file=out, width=width).print(fitted_table(columns, rows, width))
    _assert_fits(out.getvalue(), width)
    assert rows_by_first_cell(out.getvalue()) == names
    assert all(r[1] in out.getvalue() and r[2] in out.getvalue() for r in rows)


# -- commands ---------------------------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
def test_formats_fits_with_every_name_whole(width):
    result = CliRunner().invoke(cli, ["formats"], env={"COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    _assert_fits(result.stdout, width)
    data = json.loads(CliRunner().invoke(cli, ["formats", "--json", "-"]).stdout)
    for record in data["formats"]:
        for name in (record["format"], record["vllm_layout"]):
            assert any(name in line for line in _lines(result.stdout)), name


@pytest.fixture(scope="module")
def nvfp4_tiny(tiny, tmp_path_factory):
    """The tiny draft in NVFP4: the longest module kinds (weight_global_scale)."""
    return str(
        quantize_checkpoint(tiny, tmp_path_factory.mktemp("q") / "nvfp4", "nvfp4").output_dir
    )


@pytest.mark.parametrize("width", WIDTHS)
def test_inspect_fits_with_every_module_kind_whole(nvfp4_tiny, width):
    result = CliRunner().invoke(cli, ["inspect", nvfp4_tiny], env={"COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    _assert_fits(result.stdout, width)
    data = json.loads(CliRunner().invoke(cli, ["inspect", nvfp4_tiny, "--json", "-"]).stdout)
    kinds = [row["kind"] for row in data["kinds"]]
    assert rows_by_first_cell(result.stdout)[: len(kinds)] == kinds
    if width == 100:  # every kind of the tiny draft fits on one line but the longest two
        assert sum(kind not in result.stdout for kind in kinds) <= 8


# -- eval-drift's report ----------------------------------------------------------------------


def _results(name: str) -> dict:
    """The shipped results as the card reads them (their schema's mode names renamed)."""
    from qstream.card.results import check_results

    path = EXAMPLES / name / "results.json"
    return check_results(json.loads(path.read_text()), path)


def _with_differing_sets(results: dict) -> dict:
    """The card example's results as if the shipped checkpoint quantized more tensors than the
    simulated formats: the card names it ``shipped-fp8 (quantizes N tensors; ...)``."""
    out = copy.deepcopy(results)
    for block in out["regimes"].values():
        shipped = block["variants"]["shipped-fp8"]
        shipped["quantized_tensors"] = shipped["quantized_tensors"] + ["extra.weight"]
    return out


def _report(results: dict, width: int) -> str:
    out = io.StringIO()
    print_report(Console(file=out, width=width), results)
    return out.getvalue()


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("example", ["card_tiny", "capture_tiny"])
def test_the_report_fits_unsplit_with_names_whole(example, width):
    results = _results(example)
    text = _report(results, width)
    _assert_fits(text, width)
    assert "(1/" not in text and "(2/" not in text, "a table was split"
    for regime, block in results["regimes"].items():
        for variant in block["variants"]:
            assert any(f" {variant} " in f" {line} " for line in _lines(text)), variant
    labels = grouped_labels(text)
    assert "greedy agree, all positions [95% CI]" in labels
    assert "confidence r, head vLLM 0.32 runs in fp32 for adaptive verification [95% CI]" in labels
    assert "seq agree (token k), sampled rollout (T=1.0, full softmax)" in labels
    assert "prefix agree (tokens 1..k), sampled rollout (T=1.0, full softmax)" in labels


def test_variants_are_named_short_with_one_note_when_their_quantized_sets_differ():
    text = _report(_with_differing_sets(_results("card_tiny")), 100)
    _assert_fits(text, 100)
    assert "(quantizes" not in text  # the card's long label, too wide for a column
    assert text.count("do not quantize the same tensors") == 1
    assert "shipped-fp8 quantizes 27 tensors" in " ".join(text.split())


def test_every_metric_of_a_regime_is_one_row_per_variant_when_the_variants_do_not_fit():
    text = _report(_results("card_tiny"), 100)
    header = next(line for line in _lines(text) if line.startswith("metric"))
    assert [c.strip() for c in header.split("┃")] == ["metric", "variant", "value"]


# -- at 80 columns: no word or value split ----------------------------------------------------


def _split_cells(results: dict, text: str) -> list[str]:
    """The cells of the report's tables that no printed line shows whole: a value (a number
    and its interval) whole, a label part by part (a name wraps only between its words and
    dotted parts)."""
    from qstream.card.results import collect_results
    from qstream.card.terminal import SOURCE, report_parts, short_names
    from qstream.tablefit import Table, _parts

    rs = collect_results([(results, SOURCE)])
    names, lines = short_names(rs), _lines(text)
    split = []
    for part in report_parts(rs):
        if not isinstance(part, Table):
            continue
        for row in part.rows:
            for cell, align in zip(row, part.align):
                label = names.get(cell.text, cell.text)
                pieces = (
                    [label]
                    if align == "r"
                    else [p.replace("\xa0", " ").strip() for p in _parts(label)]
                )
                split += [p for p in pieces if p and not any(p in line for line in lines)]
    return split


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("example", ["card_tiny", "capture_tiny"])
def test_no_table_splits_a_word_or_a_value(example, width):
    """At 80 columns the adaptive-verification table's values and its mode labels do not fit
    side by side: the table gives one row per value (its column named beside it) instead of
    splitting "probabilistic" or "1.75 [1.72, 1.78]"."""
    results = _results(example)
    text = _report(results, width)
    _assert_fits(text, width)
    assert _split_cells(results, text) == []
    assert "probabilistic × block, adaptive" in grouped_labels(text)


def test_help_fits_80_columns():
    result = CliRunner().invoke(cli, ["--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    _assert_fits(result.stdout, 80)


def test_verify_ok_line_wraps_at_80_columns(nvfp4_tiny):
    result = CliRunner().invoke(cli, ["verify", nvfp4_tiny], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    _assert_fits(result.stdout, 80)
    assert result.stdout.startswith("OK: ") and "tensor_parallel_size 1" in result.stdout


@pytest.mark.parametrize("width", [80, 30])
def test_a_title_wider_than_its_table_is_never_squeezed_into_the_table(width):
    """A narrow table's long caption (speculate's share-accepting-at-least-k table) is broken
    at words to the terminal's width, not to the table's, and loses no word."""
    title = "share of verifications accepting at least k drafted tokens"
    out = io.StringIO()
    table = fitted_table([Column("k", True), Column("bf16", True)], [["1", "0.332"]], width,
                         title=title)  # fmt: skip
    Console(file=out, width=width).print(table)
    lines = out.getvalue().splitlines()
    head = lines[: lines.index(next(x for x in lines if "┃" in x))]
    assert " ".join(x.strip() for x in head) == title
    assert all(len(x) <= width for x in head)
    assert len(head) == (1 if width >= len(title) else len(wrap(title, width)))
