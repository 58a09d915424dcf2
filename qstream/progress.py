"""What a command shows on stderr while it works (docs/guarantees.md, "Shown"): on a terminal a
rich bar or spinner naming the step from the first moment; elsewhere one plain line every
LINE_EVERY seconds.  eval-drift's progress (:class:`DriftProgress`) runs on the work it planned
and has one estimate of the time left, :class:`WorkEta`.

>>> with step("drawing the figures"):
...     draw()
>>> with counter("synth tiny", "bytes") as report:
...     write(progress=report)  # report(done, total)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

# qstream.eval.settings.VARIANTS, spelt out: quantize and synth use this module without eval.
VARIANTS = "variants"
LINE_EVERY = 30.0  # seconds between two progress lines when stderr is not a terminal
LONG_RUN_SECONDS = 600  # a run expected to take longer says, once, how to shorten it
ADVICE = (
    "About {minutes:.0f} min left at the pace so far. The time scales with --blocks (half the "
    "blocks: half the time, intervals about 1.4x wider); on a GPU, --device cuda."
)


def clock_text(seconds: float | None) -> str:
    """``0:08:34``, or ``-:--:--`` when unknown (rich's own spelling)."""
    return "-:--:--" if seconds is None else str(timedelta(seconds=round(seconds)))


class WorkEta:
    """The time a run has left, from the work it planned: each kind of pass (an FP32 reference,
    the variants, the sensitivity steps) timed at its own pace, seconds per unit of work, and
    its work left charged at that pace; a kind not yet timed at the pace of those that have.
    A kind's pace is taken after its first pass (``step``), whose one-off start-up (kernels
    and shapes met for the first time, pages read, lazy set-up) would otherwise be
    extrapolated over the whole run; until then, with it.  The time since the last report
    counts as spent on the work left."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.planned: dict[str, float] = {}  # kind -> work planned
        self.done: dict[str, float] = {}  # kind -> work done
        self.seconds: dict[str, float] = {}  # kind -> seconds spent on it
        self.paced: dict[str, list[float]] = {}  # kind -> [work, seconds] after its first pass
        self.first: dict[str, str] = {}  # kind -> its first pass's step, while it runs
        self.since: float | None = None  # the last report (or the plan)

    def plan(self, work: Mapping[str, float]) -> None:
        self.planned = dict(work)
        self.done = dict.fromkeys(work, 0.0)
        self.seconds = dict.fromkeys(work, 0.0)
        self.paced, self.first = {}, {}
        self.since = self.clock()

    def report(self, kind: str, work: float, step: str = "") -> None:
        """``work`` more done in a pass of ``kind`` named ``step``; the time since the last
        report was its."""
        if self.since is None or kind not in self.planned:
            return
        now, first = self.clock(), self.first.get(kind)
        if first is None and work > 0 and kind not in self.paced:
            self.first[kind] = step
        elif first is not None and step != first:  # its second pass begins
            self.paced[kind] = [0.0, 0.0]
            del self.first[kind]
        if kind in self.paced:
            self.paced[kind][0] += work
            self.paced[kind][1] += now - self.since
        self.done[kind] += work
        self.seconds[kind] += now - self.since
        self.since = now

    def _pace(self, kind: str) -> float | None:
        """Seconds per unit of ``kind``'s work: after its first pass, else with it."""
        work, seconds = self.paced.get(kind, (0.0, 0.0))
        if work > 0:
            return seconds / work
        return self.seconds[kind] / self.done[kind] if self.done[kind] > 0 else None

    @property
    def measured(self) -> bool:
        """Every kind with work left is timed past its first pass (or, a kind run in one long
        pass, over half its work): the estimate is neither borrowed nor dominated by start-up."""
        left = [k for k, planned in self.planned.items() if self.done[k] < planned * (1 - 1e-9)]
        return bool(self.planned) and all(
            self.paced.get(k, (0.0,))[0] > 0 or self.done[k] >= self.planned[k] / 2 for k in left
        )

    def seconds_left(self) -> float | None:
        """The estimate, or None before any work is done."""
        paces = {k: self._pace(k) for k in self.planned}
        known = [p for p in paces.values() if p is not None]
        if self.since is None or not known:
            return None
        borrowed = max(known)  # a kind not yet run: the slowest pace so far
        left = 0.0
        for k, planned in self.planned.items():
            pace = paces[k]
            left += (borrowed if pace is None else pace) * max(0.0, planned - self.done[k])
        return max(0.0, left - (self.clock() - self.since))


class Lines:
    """Progress as plain lines: ``status()`` printed every ``every`` seconds by a daemon thread
    until the block ends (``tick`` prints one now)."""

    def __init__(self, console: Console, status: Callable[[], str], every: float | None = None):
        self.console, self.status = console, status
        self.every = LINE_EVERY if every is None else every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Lines:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.tick()

    def tick(self) -> None:
        self.say(self.status())

    def say(self, line: str) -> None:
        self.console.print(Text(line), soft_wrap=True)


@contextmanager
def step(what: str, console: Console | None = None) -> Iterator[None]:
    """A spinner naming ``what`` while the block runs (plain lines off a terminal)."""
    console = console or Console(stderr=True)
    started = time.monotonic()
    if not console.is_terminal:
        with Lines(console, lambda: f"{what}: {clock_text(time.monotonic() - started)} elapsed"):
            yield
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        bar.add_task(what, total=None)
        yield


class _Count:
    """What :func:`counter` shows: ``done`` of ``total`` ``unit`` in the step ``what``."""

    def __init__(self, what: str, unit: str):
        self.what, self.unit = what, unit
        self.done = 0
        self.total: int | None = None
        self.started = time.monotonic()
        self.shown: Callable[[], None] = lambda: None  # the bar's update, on a terminal

    def __call__(self, done: int, total: int, what: str | None = None) -> None:
        self.done, self.total, self.what = done, total, what or self.what
        self.shown()

    def line(self) -> str:
        total = "" if self.total is None else f" of {self.total:,}"
        elapsed = clock_text(time.monotonic() - self.started)
        return f"{self.what}: {self.done:,}{total} {self.unit}, {elapsed} elapsed"


@contextmanager
def counter(what: str, unit: str, console: Console | None = None) -> Iterator[Callable[..., None]]:
    """``report(done, total)`` of ``unit`` ("bytes" shows sizes) on a bar with rich's ETA, or
    as plain lines off a terminal; ``report(done, total, what)`` also renames the step."""
    console = console or Console(stderr=True)
    count = _Count(what, unit)
    if not console.is_terminal:
        with Lines(console, count.line):
            yield count
        return
    amount = (DownloadColumn(),) if unit == "bytes" else (MofNCompleteColumn(), TextColumn(unit))
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        *amount,
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(what, total=None)
        count.shown = lambda: bar.update(
            task, completed=count.done, total=count.total, description=count.what
        )
        yield count


# ---------------------------------------------------------------------------------------------
# eval-drift


class DriftProgress:
    """eval-drift's :class:`qstream.eval.settings.Progress`: the step running, the blocks
    drafted, the planned work done and the one ETA (:class:`WorkEta`); a run expected to
    outlast LONG_RUN_SECONDS says once, through ``say``, how to shorten it, as soon as every
    kind of pass with work left has been timed past its first pass (:attr:`WorkEta.measured`)."""

    def __init__(self, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.say, self.clock = say, clock
        self.eta = WorkEta(clock)
        self.started = clock()
        self.what = "loading the draft and corpus"
        self.blocks, self.work = 0, 0.0
        self.total_blocks: int | None = None
        self.total_work: float | None = None
        self.advised = False
        self.bar: Progress | None = None  # where it is shown: a rich bar on a terminal,
        self.lines: Lines | None = None  # plain lines elsewhere
        self.shown: Callable[[], None] = lambda: None  # the bar's update, on a terminal

    def start(self, total: int | None, work: Mapping[str, float] | None = None) -> None:
        self.total_blocks = total
        if work is not None:
            self.total_work, self.work = sum(work.values()), 0.0
            self.eta.plan(work)
        self.shown()

    def advance(self, what: str, blocks: int, work: float = 0.0, kind: str = VARIANTS) -> None:
        self.what, self.blocks = what, self.blocks + blocks
        if self.total_work is not None:
            self.work += work
            self.eta.report(kind, work, what)
        self.shown()
        left = self.eta.seconds_left()
        if not self.advised and self.eta.measured and left is not None and left > LONG_RUN_SECONDS:
            self.advised = True
            self.say(ADVICE.format(minutes=left / 60))

    def blocks_text(self) -> str:
        total = "" if self.total_blocks is None else f"/{self.total_blocks}"
        return f"{self.blocks}{total} blocks"

    def eta_text(self) -> str:
        return clock_text(self.eta.seconds_left())

    def line(self) -> str:
        """The status as one plain line."""
        parts = [self.what]
        if self.total_work:
            parts.append(f"{100 * self.work / self.total_work:.0f}% of the planned work")
        parts += [self.blocks_text(), f"{clock_text(self.clock() - self.started)} elapsed"]
        if self.total_work:
            parts.append(f"about {self.eta_text()} left")
        return "eval-drift: " + ", ".join(parts)


class _EtaColumn(ProgressColumn):
    """The bar's ``eta``: :class:`WorkEta`'s, the run's only estimate."""

    def __init__(self, progress: DriftProgress):
        super().__init__()
        self.progress = progress

    def render(self, task) -> Text:
        return Text(f"eta {self.progress.eta_text()}", style="progress.remaining")


@contextmanager
def drift_progress(
    console: Console | None = None, clock: Callable[[], float] = time.monotonic
) -> Iterator[DriftProgress]:
    """eval-drift's progress on ``console`` (default stderr): a bar on a terminal, shown from
    the first moment (the draft and corpus load before the work is planned) and running on the
    planned work once there is a plan, the blocks beside it; plain lines elsewhere."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        lines = Lines(console, lambda: progress.line())
        progress = DriftProgress(lines.say, clock)
        progress.lines = lines
        with lines:
            yield progress
        return
    with Progress(console=console, transient=True) as bar:
        progress = DriftProgress(lambda text: bar.console.print(Text(text)), clock)
        progress.bar = bar
        bar.columns = (
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[blocks]}"),
            TimeElapsedColumn(),
            _EtaColumn(progress),
            TextColumn("{task.description}"),
        )
        task = bar.add_task(progress.what, total=None, blocks="")
        progress.shown = lambda: bar.update(
            task,
            description=progress.what,
            blocks=progress.blocks_text(),
            completed=progress.work if progress.total_work else progress.blocks,
            total=progress.total_work or progress.total_blocks,
        )
        progress.shown()
        yield progress
