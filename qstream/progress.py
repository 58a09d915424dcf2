"""What a command shows on stderr while it works (docs/guarantees.md, "Shown"): on a terminal a
rich bar or spinner naming the step, elsewhere one plain line every LINE_EVERY seconds.  Every
long-running piece reports to :class:`Progress`; every bar's one ETA is :class:`WorkEta`'s."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Protocol, TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    ProgressColumn,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as Bar
from rich.text import Text

# qstream.eval.settings.VARIANTS, spelt out: quantize and synth use this module without eval.
VARIANTS = "variants"
LINE_EVERY = 30.0  # seconds between two progress lines when stderr is not a terminal
LONG_RUN_SECONDS = 600  # a run expected to take longer says, once, how to shorten it
ADVICE = (
    "About {minutes:.0f} min left at the pace so far. The time scales with --blocks (half the "
    "blocks: half the time, intervals about 1.4x wider); on a GPU, --device cuda."
)


class Progress(Protocol):
    """Where a long-running piece reports its units done (streams, bytes, prompts, blocks) and,
    where its passes differ in cost, their work per kind of pass, from which the one ETA is
    taken (eval-drift's by the FLOP model: docs/eval-drift.md, "FLOP model")."""

    def start(self, total: int | None, work: Mapping[str, float] | None = None) -> None:
        """Units to come (None until known) and the total work per kind of pass once planned;
        called again when it is (counting restarts)."""

    def advance(self, what: str, done: int, work: float = 0.0, kind: str = VARIANTS) -> None:
        """``done`` more units, ``work`` of a ``kind`` pass, in the step ``what`` ("": the
        step named before)."""


class Silent:
    """A :class:`Progress` that reports nothing."""

    def start(self, total: int | None, work: Mapping[str, float] | None = None) -> None:
        pass

    def advance(self, what: str, done: int, work: float = 0.0, kind: str = VARIANTS) -> None:
        pass


def clock_text(seconds: float | None) -> str:
    """``0:08:34``, or ``-:--:--`` when unknown (rich's own spelling)."""
    return "-:--:--" if seconds is None else str(timedelta(seconds=round(seconds)))


class WorkEta:
    """The time a run has left: each kind of pass's work left at its own pace (seconds per unit
    of work), a kind not yet timed at the slowest pace so far.  A pace is taken after the kind's
    first pass, whose one-off start-up would otherwise be extrapolated over the whole run."""

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
        """``work`` more done in a pass of ``kind`` named ``step``, in the time since the last."""
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
    """``status()`` printed every ``every`` seconds by a daemon thread until the block ends."""

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
def step(what: str) -> Iterator[None]:
    """A spinner naming ``what`` on stderr while the block runs (plain lines off a terminal)."""
    console = Console(stderr=True)
    started = time.monotonic()
    if not console.is_terminal:
        with Lines(console, lambda: f"{what}: {clock_text(time.monotonic() - started)} elapsed"):
            yield
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Bar(*columns, console=console, transient=True) as bar:
        bar.add_task(what, total=None)
        yield


class Shown:
    """A :class:`Progress` shown on a console (a rich bar on a terminal, else plain lines): the
    step, the units done, the planned work done (a counter's units) and the one ETA."""

    counts_work = True  # ``start(total)`` plans the units as the work (eval-drift's: no plan)

    def __init__(self, what: str, unit: str, clock: Callable[[], float] = time.monotonic):
        self.what, self.unit, self.clock = what, unit, clock
        self.eta = WorkEta(clock)
        self.started = clock()
        self.done, self.work = 0, 0.0
        self.total: int | None = None
        self.total_work: float | None = None
        self.units_are_work = False  # set by start: no work planned by kind
        self.say: Callable[[str], None] = lambda text: None
        self.bar: Bar | None = None
        self.lines: Lines | None = None
        self.shown: Callable[[], None] = lambda: None

    def start(self, total: int | None, work: Mapping[str, float] | None = None) -> None:
        self.total, self.done = total, 0
        self.units_are_work = work is None and self.counts_work and total is not None
        if self.units_are_work:
            work = {VARIANTS: float(total or 0)}
        if work is not None:
            self.total_work, self.work = sum(work.values()), 0.0
            self.eta.plan(work)
        self.shown()

    def advance(self, what: str, done: int, work: float = 0.0, kind: str = VARIANTS) -> None:
        self.what, self.done = what or self.what, self.done + done
        if self.units_are_work:
            work, kind = float(done), VARIANTS
        if self.total_work is not None:
            self.work += work
            self.eta.report(kind, work, self.what)
        self.shown()

    def eta_text(self) -> str:
        return clock_text(self.eta.seconds_left())

    def elapsed_text(self) -> str:
        return clock_text(self.clock() - self.started)

    def line(self) -> str:
        total = "" if self.total is None else f" of {self.total:,}"
        return f"{self.what}: {self.done:,}{total} {self.unit}, {self.elapsed_text()} elapsed"

    def blocks_text(self) -> str:
        total = "" if self.total is None else f"/{self.total}"
        return f"{self.done}{total} {self.unit}"


class DriftProgress(Shown):
    """eval-drift's :class:`Progress`: its line, and once the ETA is :attr:`WorkEta.measured`
    and over LONG_RUN_SECONDS, the advice (once) on how to shorten the run."""

    counts_work = False

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        super().__init__("loading the draft and corpus", "blocks", clock)
        self.advised = False

    def advance(self, what: str, done: int, work: float = 0.0, kind: str = VARIANTS) -> None:
        super().advance(what, done, work, kind)
        left = self.eta.seconds_left()
        if not self.advised and self.eta.measured and left is not None and left > LONG_RUN_SECONDS:
            self.advised = True
            self.say(ADVICE.format(minutes=left / 60))

    def line(self) -> str:
        parts = [self.what]
        if self.total_work:
            parts.append(f"{100 * self.work / self.total_work:.0f}% of the planned work")
        parts += [self.blocks_text(), f"{self.elapsed_text()} elapsed"]
        if self.total_work:
            parts.append(f"about {self.eta_text()} left")
        return "eval-drift: " + ", ".join(parts)


class _EtaColumn(ProgressColumn):
    """The bar's time left: :class:`WorkEta`'s, the run's only estimate (``label`` before it)."""

    def __init__(self, progress: Shown, label: str = "eta "):
        super().__init__()
        self.progress, self.label = progress, label

    def render(self, task) -> Text:
        return Text(f"{self.label}{self.progress.eta_text()}", style="progress.remaining")


S = TypeVar("S", bound=Shown)


@contextmanager
def shown(progress: S, console: Console | None, *columns: ProgressColumn) -> Iterator[S]:
    """``progress`` on ``console`` (default stderr): a transient bar of ``columns`` on a
    terminal, the work done of the work planned, else the units; plain lines elsewhere."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        progress.lines = Lines(console, progress.line)
        progress.say = progress.lines.say
        with progress.lines:
            yield progress
        return
    with Bar(*columns, console=console, transient=True) as bar:
        progress.bar, progress.say = bar, lambda text: bar.console.print(Text(text))
        task = bar.add_task(progress.what, total=None, blocks="")

        def update() -> None:
            planned = bool(progress.total_work) and not progress.units_are_work
            bar.update(
                task,
                description=progress.what,
                blocks=progress.blocks_text(),
                completed=progress.work if planned else progress.done,
                total=progress.total_work if planned else progress.total,
            )

        progress.shown = update
        update()
        yield progress


def counter(what: str, unit: str) -> AbstractContextManager[Shown]:
    """A :class:`Progress` counting ``unit`` ("bytes" shows sizes) in the step ``what``."""
    progress = Shown(what, unit)
    amount = (DownloadColumn(),) if unit == "bytes" else (MofNCompleteColumn(), TextColumn(unit))
    return shown(
        progress,
        None,
        TextColumn("{task.description}"),
        BarColumn(),
        *amount,
        TimeElapsedColumn(),
        _EtaColumn(progress, label=""),
    )


def drift_progress(
    console: Console | None = None, clock: Callable[[], float] = time.monotonic
) -> AbstractContextManager[DriftProgress]:
    """eval-drift's progress: the bar runs on the planned work once there is a plan (the draft
    and corpus load before), the blocks beside it."""
    progress = DriftProgress(clock)
    return shown(
        progress,
        console,
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[blocks]}"),
        TimeElapsedColumn(),
        _EtaColumn(progress),
        TextColumn("{task.description}"),
    )
