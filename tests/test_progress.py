"""Long work shows progress on stderr from its first moment, on a terminal only, and never under
``--json -`` (DESIGN.md section 2)."""

import io

from rich.console import Console

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


def test_quiet_under_json_stdout_and_off_a_terminal():
    console, out = _terminal()
    with blocks_progress(console, quiet=True) as progress:
        assert isinstance(progress, Silent)
    with blocks_progress(Console(file=io.StringIO(), force_terminal=False)) as progress:
        assert isinstance(progress, Silent)
    assert out.getvalue() == ""
