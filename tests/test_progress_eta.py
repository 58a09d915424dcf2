"""eval-drift has one estimate of the time left (qstream/progress.py, ``WorkEta``), taken from the
work it planned: the bar's ``eta``, the plain progress lines and the one-off advice for a long
run all read it, so they cannot disagree; and the plan is exactly the work the run reports."""

import io
import re
from dataclasses import replace

import pytest
from rich.console import Console
from rich.progress import TimeRemainingColumn

from qstream.eval.drift import evaluate_drift
from qstream.eval.settings import REFERENCE, STEPS, VARIANTS, DriftSettings
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
    eta.report(REFERENCE, 100.0, "heavy: reference")  # 0.1 s per unit; the variants borrow it
    assert not eta.measured and eta.seconds_left() == pytest.approx(40.0)
    clock.now = 14.0
    eta.report(VARIANTS, 100.0, "heavy: bf16")  # 0.04 s per unit, in its first pass
    assert not eta.measured and eta.seconds_left() == pytest.approx(300 * 0.04)
    clock.now = 16.0  # the time since the last report is spent on the work left
    assert eta.seconds_left() == pytest.approx(300 * 0.04 - 2)
    clock.now = 20.0
    eta.report(VARIANTS, 0.0, "heavy: simulating fp8")  # the second pass begins: its own pace
    assert eta.seconds_left() == pytest.approx(300 * 10 / 100)  # none of its work yet
    clock.now = 22.0
    eta.report(VARIANTS, 100.0, "heavy: fp8")  # 100 units in 6 + 2 s, past the first pass
    assert eta.measured and eta.seconds_left() == pytest.approx(200 * 0.08)


def test_a_kind_run_in_one_pass_counts_as_measured_over_half_its_work():
    clock = Clock()
    eta = WorkEta(clock)
    eta.plan({REFERENCE: 100.0, VARIANTS: 400.0})  # one variant: one pass of four batches
    eta.report(REFERENCE, 100.0, "heavy: reference")
    eta.report(VARIANTS, 100.0, "heavy: nvfp4")
    assert not eta.measured
    eta.report(VARIANTS, 100.0, "heavy: nvfp4")
    assert eta.measured


def _passes(regimes: int, variants: int, batches: int, unit: float, first: float):
    """The reports of a run: per regime a reference pass, then each variant's (simulated:
    one second's set-up without work), each pass ``batches`` batches of 100 units at
    ``unit`` s per unit, the first pass of each kind at ``first``: (seconds, step, work,
    kind)."""
    out, firsts = [], {REFERENCE, VARIANTS}
    for r in range(regimes):
        for v in range(1 + variants):
            kind = REFERENCE if v == 0 else VARIANTS
            pace = first if kind in firsts else unit
            firsts.discard(kind)
            if v > 1:
                out.append((1.0, f"{r}: simulating {v}", 0.0, kind))
            out += [(100 * pace, f"{r}: {v}", 100.0, kind)] * batches
    return out


def test_a_first_pass_slowed_by_start_up_is_not_extrapolated():
    """The first pass of each kind meets its kernels, shapes and pages for the first time: on
    a busy machine ten times its later pace.  Extrapolated from there, the estimate was 6x
    the time left ("About 90 min left" for a 7-minute run); taken after each kind's first
    pass, it is within 1.5x of it whenever it counts as measured (when the advice is given)."""
    reports = _passes(regimes=3, variants=4, batches=4, unit=1.0, first=10.0)
    total = sum(seconds for seconds, *_ in reports)
    clock = Clock()
    eta = WorkEta(clock)
    eta.plan({REFERENCE: 3 * 400.0, VARIANTS: 3 * 4 * 400.0})
    ratios = []
    for seconds, step, work, kind in reports:
        clock.now += seconds
        eta.report(kind, work, step)
        left = eta.seconds_left()
        if eta.measured and total - clock.now > 0:
            ratios.append(left / (total - clock.now))
    assert ratios and all(1 / 1.5 <= r <= 1.5 for r in ratios), ratios
    assert clock.now == total and eta.seconds_left() == 0


def _run_long(clock: Clock, out: io.StringIO, terminal: bool):
    """A run planned at 100 units of reference work and 9000 of variants', whose reference
    runs at 1 s per unit and variants at 0.1 (bf16's pass, the first, at 0.2): once the
    second variant pass is timed its estimate passes LONG_RUN_SECONDS."""
    console = Console(file=out, force_terminal=terminal, width=120)
    context = drift_progress(console, clock)
    progress = context.__enter__()
    progress.start(20, {REFERENCE: 100.0, VARIANTS: 9000.0})
    clock.now = 100.0
    progress.advance("heavy: reference", 1, 100.0, REFERENCE)
    clock.now = 120.0
    progress.advance("heavy: bf16", 1, 100.0, VARIANTS)
    return context, progress


def _minutes(text: str) -> int:
    return int(re.search(r"About (\d+) min left", text)[1])  # type: ignore[index]


def _seconds(clock_text: str) -> int:
    h, m, s = (int(x) for x in clock_text.split(":"))
    return 3600 * h + 60 * m + s


def test_the_advice_and_the_bar_show_the_same_one_estimate():
    clock, out = Clock(), io.StringIO()
    context, progress = _run_long(clock, out, terminal=True)
    # the variants are timed only in their first pass: an estimate, but no advice yet
    assert progress.eta.seconds_left() > LONG_RUN_SECONDS and "About" not in out.getvalue()
    clock.now = 130.0
    progress.advance("heavy: fp8", 1, 100.0, VARIANTS)
    left = progress.eta.seconds_left()  # 8800 x 0.1 s
    assert left == pytest.approx(880.0)
    bar = progress.bar
    etas = [c for c in bar.columns if isinstance(c, (_EtaColumn, TimeRemainingColumn))]
    assert len(etas) == 1 and isinstance(etas[0], _EtaColumn)  # rich's own ETA is not shown
    shown = etas[0].render(bar.tasks[0]).plain
    context.__exit__(None, None, None)
    assert shown == "eta 0:14:40"
    assert _minutes(out.getvalue()) == round(_seconds(shown.split()[1]) / 60) == 15
    assert out.getvalue().count("About") == 1


def test_the_plain_lines_show_the_same_estimate_and_the_advice_once():
    clock, out = Clock(), io.StringIO()
    context, progress = _run_long(clock, out, terminal=False)
    clock.now = 130.0
    progress.advance("heavy: fp8", 1, 100.0, VARIANTS)
    progress.advance("heavy: fp8", 1, 0.0, VARIANTS)
    progress.lines.tick()
    context.__exit__(None, None, None)
    advice, line = out.getvalue().splitlines()
    left = re.search(r"about (\S+) left", line)[1]
    assert left == "0:14:40" and _minutes(advice) == 15


def test_lines_print_nothing_for_a_block_shorter_than_their_interval():
    out = io.StringIO()
    with Lines(Console(file=out), lambda: "step: 0:00:01 elapsed", every=60):
        pass
    assert out.getvalue() == ""


class _Record:
    """A Progress that adds up what the run reports, beside what it planned."""

    def __init__(self):
        self.blocks, self.work = 0, {REFERENCE: 0.0, VARIANTS: 0.0, STEPS: 0.0}

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
        regime=("gauss",),
        formats=("bf16", "nvfp4"),
        blocks=8,
        sensitivity=True,
        context_lengths=(32, 64),
        context_blocks=4,
    )
    evaluate_drift(replace(settings, model=tiny), corpus, progress=record)
    assert record.planned_blocks == record.blocks
    assert record.planned_work == pytest.approx(record.work, rel=1e-12)
    assert record.work[REFERENCE] > 0 and record.work[VARIANTS] > record.work[REFERENCE]
    # the sensitivity steps (drift only, no verifier) are timed on their own account
    assert record.work[STEPS] > record.work[VARIANTS]
