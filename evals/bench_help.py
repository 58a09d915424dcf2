"""CPU time of the help screens against a bare ``python -c 'import click'`` (docs/guarantees.md,
"Help"): ``qstream --help``, ``qstream-quantize --help`` and every ``qstream COMMAND --help``.

Each screen runs in a fresh interpreter (the same one as the peer) through the console
scripts' own entry points (``qstream.entry``), as typing the command does; its CPU time (user +
system, from the child's rusage) is the best of ``--rounds`` runs, screens and peer interleaved
so that a busy moment of a shared machine hits them alike.  Printed per screen: the seconds,
the difference from the peer and the ratio to it.  The target is a difference of at most
0.3 s; ``--check`` exits 1 when a screen misses it.

    PYTHONPATH=. python evals/bench_help.py [--rounds 5] [--check]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys

from qstream.cli import COMMANDS

TARGET_S = 0.3  # CPU seconds a help screen may take above `import click`
PEER = ("python -c 'import click'", "import click")


def _screen(script: str, args: list[str]) -> tuple[str, str]:
    """(label, code): the console script ``script`` of qstream.entry run with ``args``."""
    label = " ".join(["qstream" if script == "main" else "qstream-quantize", *args])
    code = f"import sys; sys.argv = ['qstream', *{args!r}]; from qstream import entry; entry.{script}()"
    return label, code


def screens() -> list[tuple[str, str]]:
    out = [_screen("main", ["--help"]), _screen("quantize_main", ["--help"])]
    return out + [_screen("main", [name, "--help"]) for name in COMMANDS]


def cpu_seconds(code: str) -> float:
    """User + system CPU of one fresh interpreter running ``code``, its output discarded."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(rounds: int) -> dict[str, float]:
    """Best of ``rounds`` CPU seconds per label, the peer included, runs interleaved."""
    runs = [PEER, *screens()]
    best = {label: float("inf") for label, _ in runs}
    for _ in range(rounds):
        for label, code in runs:
            best[label] = min(best[label], cpu_seconds(code))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="runs per screen (best is kept)")
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"exit 1 if a screen is over {TARGET_S} s above the peer",
    )
    options = parser.parse_args()
    best = measure(options.rounds)
    peer = best.pop(PEER[0])
    print(f"{sys.executable}, best of {options.rounds}: {PEER[0]} {peer:.3f} s CPU")
    width = max(map(len, best))
    print(f"{'screen':<{width}}  {'CPU s':>6}  {'- peer':>6}  {'/ peer':>6}")
    for label, seconds in best.items():
        print(f"{label:<{width}}  {seconds:6.3f}  {seconds - peer:+6.3f}  {seconds / peer:5.1f}x")
    over = [label for label, seconds in best.items() if seconds - peer > TARGET_S]
    print(
        f"target: at most {TARGET_S} s above the peer; "
        + (f"missed by {', '.join(over)}" if over else "met by every screen")
    )
    return 1 if options.check and over else 0


if __name__ == "__main__":
    sys.exit(main())
