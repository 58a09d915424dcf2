"""The console scripts' entry points.  They import the command line inside a guard, so that
Ctrl-C at any moment, even while Python is still importing torch or click, ends with
``Aborted!`` and exit status 1 as click does, never a traceback (docs/guarantees.md)."""

from __future__ import annotations

import importlib
import sys


def _run(name: str) -> None:
    try:
        getattr(importlib.import_module("qstream.cli"), name)()
    except KeyboardInterrupt:
        print("\nAborted!", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    _run("main")


def quantize_main() -> None:
    _run("quantize_main")
