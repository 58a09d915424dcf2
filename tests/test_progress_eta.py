"""eval-drift has one estimate of the time left (qstream/progress.py, ``WorkEta``), taken from the
work it planned: the bar's ``eta``, the plain progress lines and the one-off advice for a long
run all read it, so they cannot disagree; and the plan is exactly the work the run reports."""

import io
import re

import pytest
from rich.console import Console
from rich.progress import TimeRemainingColumn

from qstream.eval.drift import evaluate_drift
from qstream.eval.settings import REFERENCE, VARIANTS, DriftSettings
from qstream.progress import LONG_RUN_SECONDS, Lines, WorkEta, _EtaColumn, drift_progress


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_kind_of_pass_is_timed_at_its_own_pace():
    clock = Clock()
    eta = WorkEta(clock)
    eta.plan({REFERENCE: 100.0, VARIANTS: 400.0})
    assert eta.seconds_left() is None  # nothing done: no estimate
    clock.now = 10.0
    eta.report(REFERENCE, 100.0)  # 0.1 s per unit; the variants, not yet run, borrow it
    assert not eta.measured and eta.seconds_left() == pytest.approx(40.0)
    clock.now = 14.0
    eta.report(VARIANTS, 100.0)  # 0.04 s per unit
    assert eta.measured and eta.seconds_left() == pytest.approx(300 * 0.04)
    clock.now = 16.0  # the time since the last report is spent on the work left
    assert eta.seconds_left() == pytest.approx(300 * 0.04 - 2)
    clock.now = 20.0
    eta.report(VARIANTS, 0.0)  # building a variant: a variant pass's time, without work
    assert eta.seconds_left() == pytest.approx(300 * 10 / 100)


def _run_long(clock: Clock, out: io.StringIO, terminal: bool):
    """A run planned at 1000 units of reference work and 9000 of variants', whose reference
    runs at 1 s per unit and variants at 0.1: its estimate passes LONG_RUN_SECONDS."""
    console = Console(file=out, force_terminal=terminal, width=120)
    context = drift_progress(console, clock)
    progress = context.__enter__()
    progress.start(20, {REFERENCE: 1000.0, VARIANTS: 9000.0})
    clock.now = 100.0
    progress.advance("heavy: reference", 1, 100.0, REFERENCE)
    return context, progress


def _minutes(text: str) -> int:
    return int(re.search(r"About (\d+) min left", text)[1])  # type: ignore[index]


def _seconds(clock_text: str) -> int:
    h, m, s = (int(x) for x in clock_text.split(":"))
    return 3600 * h + 60 * m + s


def test_the_advice_and_the_bar_show_the_same_one_estimate():
    clock, out = Clock(), io.StringIO()
    context, progress = _run_long(clock, out, terminal=True)
    # only the reference is timed: the estimate borrows its pace (9900 s), no advice yet
    assert progress.eta.seconds_left() > LONG_RUN_SECONDS and "About" not in out.getvalue()
    clock.now = 110.0
    progress.advance("heavy: bf16", 1, 100.0, VARIANTS)
    left = progress.eta.seconds_left()  # 900 x 1 s + 8900 x 0.1 s
    assert left == pytest.approx(1790.0)
    bar = progress.bar
    etas = [c for c in bar.columns if isinstance(c, (_EtaColumn, TimeRemainingColumn))]
    assert len(etas) == 1 and isinstance(etas[0], _EtaColumn)  # rich's own ETA is not shown
    shown = etas[0].render(bar.tasks[0]).plain
    context.__exit__(None, None, None)
    assert shown == "eta 0:29:50"
    assert _minutes(out.getvalue()) == round(_seconds(shown.split()[1]) / 60) == 30
    assert out.getvalue().count("About") == 1


def test_the_plain_lines_show_the_same_estimate_and_the_advice_once():
    clock, out = Clock(), io.StringIO()
    context, progress = _run_long(clock, out, terminal=False)
    clock.now = 110.0
    progress.advance("heavy: bf16", 1, 100.0, VARIANTS)
    progress.advance("heavy: bf16", 1, 0.0, VARIANTS)
    progress.lines.tick()
    context.__exit__(None, None, None)
    advice, line = out.getvalue().splitlines()
    left = re.search(r"about (\S+) left", line)[1]
    assert left == "0:29:50" and _minutes(advice) == 30


def test_lines_print_nothing_for_a_block_shorter_than_their_interval():
    out = io.StringIO()
    with Lines(Console(file=out), lambda: "step: 0:00:01 elapsed", every=60):
        pass
    assert out.getvalue() == ""


class _Record:
    """A Progress that adds up what the run reports, beside what it planned."""

    def __init__(self):
        self.blocks, self.work = 0, {REFERENCE: 0.0, VARIANTS: 0.0}

    def start(self, total, work=None):
        self.planned_blocks, self.planned_work = total, work

    def advance(self, what, blocks, work=0.0, kind=VARIANTS):
        self.blocks += blocks
        self.work[kind] += work


def test_the_plan_is_the_work_the_run_reports_sensitivity_steps_included(tiny, corpus):
    """The total (and so the ETA) covers every pass: the reference's, each variant's, each
    sensitivity step's (the floor, each module kind alone, each kind added) and each context
    bucket's, each kind of pass on its own account."""
    record = _Record()
    settings = DriftSettings(
        regimes=("gauss",),
        formats=("bf16", "nvfp4"),
        n_blocks=8,
        sensitivity=True,
        context_lengths=(32, 64),
        context_blocks=4,
    )
    evaluate_drift(tiny, settings, corpus, progress=record)
    assert record.planned_blocks == record.blocks
    assert record.planned_work == pytest.approx(record.work, rel=1e-12)
    assert record.work[REFERENCE] > 0 and record.work[VARIANTS] > record.work[REFERENCE]
