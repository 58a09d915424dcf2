"""What a terminal shows: eval-drift's progress on stderr from the first moment, plain lines
when stderr is not a terminal (``--json -`` included: stdout keeps the JSON alone); tables that
fit 100 columns, never split, whole with ``--wide`` (docs/guarantees.md, "Shown").  The one ETA
is tests/test_progress_eta.py's, the widths tests/test_terminal_width.py's."""

import io
import json

from click.testing import CliRunner
from rich.console import Console

import qstream.progress
from qstream.cli import cli
from qstream.progress import DriftProgress, drift_progress


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=100), out


def _task(progress: DriftProgress):
    assert progress.bar is not None
    [task] = progress.bar.tasks
    return task


def test_the_bar_shows_loading_before_the_total_is_known():
    console, _ = _terminal()
    with drift_progress(console) as progress:
        task = _task(progress)
        assert task.description == "loading the draft and corpus" and task.total is None
        progress.advance("heavy: simulating nvfp4", 0)
        progress.start(10)
        progress.advance("heavy: reference", 4, kind="reference")
        task = _task(progress)
        assert (task.description, task.total, task.completed) == ("heavy: reference", 10, 4)
        assert task.fields["blocks"] == "4/10 blocks"


def test_once_the_work_is_planned_the_bar_runs_on_it():
    # a long-context block costs hundreds of short ones: the bar (and its ETA) advance by work,
    # the blocks are counted beside it
    console, _ = _terminal()
    with drift_progress(console) as progress:
        progress.start(10)
        progress.start(10, {"reference": 500.0, "variants": 500.0})
        progress.advance("heavy: reference", 8, 200.0, "reference")
        progress.advance("heavy: reference", 2, 600.0, "reference")
        task = _task(progress)
        assert (task.total, task.completed) == (1000.0, 800.0)
        assert task.fields["blocks"] == "10/10 blocks"


def test_off_a_terminal_the_progress_is_plain_lines():
    out = io.StringIO()
    with drift_progress(Console(file=out, force_terminal=False, width=100)) as progress:
        progress.start(4, {"reference": 10.0, "variants": 30.0})
        progress.advance("gauss: reference", 4, 10.0, "reference")
        assert out.getvalue() == ""  # the first line comes after LINE_EVERY seconds
        assert progress.lines is not None
        progress.lines.tick()
    line = out.getvalue()
    assert line.startswith("eval-drift: gauss: reference, 25% of the planned work, 4/4 blocks")
    assert "\x1b" not in line and line.count("\n") == 1


def test_eval_drift_off_a_terminal_prints_progress_lines_on_stderr(tiny, monkeypatch):
    # the card example's eval step, its output captured: not silent for minutes
    monkeypatch.setattr(qstream.progress, "LINE_EVERY", 0.05)
    args = ["eval-drift", "--model", tiny, "--blocks", "8", "--regime", "gauss", "--json", "-"]
    result = CliRunner().invoke(cli, [*args, "--formats", "bf16"])
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)  # stdout: the JSON alone
    progress = [line for line in result.stderr.splitlines() if line.startswith("eval-drift: ")]
    assert progress, result.stderr
    assert all("elapsed" in line for line in progress)


def test_eval_drift_tables_fit_100_columns_unless_wide(tiny):
    args = ["eval-drift", "--model", tiny, "--blocks", "4", "--regime", "gauss"]
    narrow = CliRunner().invoke(cli, args)
    wide = CliRunner().invoke(cli, [*args, "--wide"])
    assert narrow.exit_code == 0 and wide.exit_code == 0, narrow.output + wide.output
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 100
    assert max(len(line) for line in wide.stdout.splitlines()) > 100
