"""What a terminal shows: progress on stderr from the first moment, on a terminal only, never
under ``--json -``; tables that fit 100 columns, split when wider, whole with ``--wide``
(docs/quantize.md)."""

import io

from click.testing import CliRunner
from rich.console import Console

from qstream.card.document import Cell, Table
from qstream.card.terminal import LABEL_MAX, rich_table, split_table
from qstream.cli import cli
from qstream.cliutil import blocks_progress
from qstream.eval.settings import Silent


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=100), out


def test_the_bar_shows_loading_before_the_total_is_known():
    console, _ = _terminal()
    with blocks_progress(console) as progress:
        [task] = progress.bar.tasks
        assert task.description == "loading the draft and corpus" and task.total is None
        progress.advance("heavy: simulating nvfp4", 0)
        progress.start(10)
        progress.advance("heavy: reference", 4)
        [task] = progress.bar.tasks
        assert (task.description, task.total, task.completed) == ("heavy: reference", 10, 4)
        assert task.fields["blocks"] == "4/10 blocks"


def test_once_the_work_is_planned_the_bar_runs_on_it():
    # a long-context block costs hundreds of short ones: the bar (and its ETA) advance by work,
    # the blocks are counted beside it
    console, _ = _terminal()
    with blocks_progress(console) as progress:
        progress.start(10)
        progress.start(10, work=1000.0)
        progress.advance("heavy: reference", 8, 200.0)
        progress.advance("heavy: reference", 2, 600.0)
        [task] = progress.bar.tasks
        assert (task.total, task.completed) == (1000.0, 800.0)
        assert task.fields["blocks"] == "10/10 blocks"


def test_quiet_under_json_stdout_and_off_a_terminal():
    console, out = _terminal()
    with blocks_progress(console, quiet=True) as progress:
        assert isinstance(progress, Silent)
    with blocks_progress(Console(file=io.StringIO(), force_terminal=False)) as progress:
        assert isinstance(progress, Silent)
    assert out.getvalue() == ""


def _wide_table(n_values: int = 5) -> Table:
    columns = ["metric", *(f"variant{i}" for i in range(n_values))]
    rows = [
        [
            Cell("a long metric label, sampled rollout (T=1.0, top-p 0.95) [95% CI]"),
            *(Cell(f"0.{i}123 [0.{i}120, 0.{i}126]") for i in range(n_values)),
        ]
    ]
    return Table("caption", columns, rows, "key")


def test_a_wide_table_is_split_into_parts_that_fit_keeping_the_labels():
    table = _wide_table()
    pieces = split_table(table, 100)
    assert len(pieces) > 1
    assert [p.caption for p in pieces] == [
        f"caption ({n}/{len(pieces)})" for n in range(1, len(pieces) + 1)
    ]
    assert all(p.columns[0] == "metric" for p in pieces)
    assert [c for p in pieces for c in p.columns[1:]] == table.columns[1:]
    for piece in pieces:
        out = io.StringIO()
        Console(file=out, width=100).print(rich_table(piece, LABEL_MAX))  # plain text
        lines = out.getvalue().splitlines()
        assert max(len(line) for line in lines) <= 100 and "…" not in out.getvalue()


def test_a_narrow_table_is_left_whole():
    table = _wide_table(1)
    table.rows[0][0] = Cell("short")
    assert split_table(table, 100) == [table]


def test_eval_drift_tables_fit_100_columns_unless_wide(tiny):
    args = ["eval-drift", "--model", tiny, "--blocks", "16", "--regime", "gauss"]
    narrow = CliRunner().invoke(cli, args)
    wide = CliRunner().invoke(cli, [*args, "--wide"])
    assert narrow.exit_code == 0 and wide.exit_code == 0, narrow.output + wide.output
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 100
    assert max(len(line) for line in wide.stdout.splitlines()) > 100
