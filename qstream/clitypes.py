"""click parameter types for option values that click's own types cannot describe: a device
name, a comma-separated list of names or numbers, ``NAME=DIR``.  They check the value alone,
when the command line is parsed, so that a malformed value is a usage error (exit status 2,
click's message naming the option), exactly like an out-of-range number or an unknown choice
(docs/guarantees.md, "Exit statuses").  What depends on more than the value (a directory that
must exist, a device this machine must have, edges a draft's context must hold) is the
library's to check, as one ``Error:`` line and exit status 1.

Each type returns the value as given: the commands and the library parse it as before."""

from __future__ import annotations

import re
from collections.abc import Sequence

import click


class Choice(click.Choice):
    """click's Choice, except that a required option left out is, like every other usage
    error, one ``Error:`` line: "Choose from fp8, mxfp4, nvfp4." (click lists the choices one
    per line)."""

    def get_missing_message(self, param, ctx):
        return f"Choose from {', '.join(map(str, self.choices))}."


class Device(click.ParamType):
    """``cpu``, ``cuda`` or ``cuda:N`` (qstream.device.resolve_device checks that the
    device exists)."""

    name = "device"

    def convert(self, value, param, ctx):
        if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
            self.fail(f"{value!r} is not cpu, cuda or cuda:N.", param, ctx)
        return value


class CommaChoice(click.ParamType):
    """Comma-separated names, each one of ``choices``."""

    name = "names"

    def __init__(self, choices: Sequence[str]):
        self.choices = tuple(choices)

    def convert(self, value, param, ctx):
        unknown = [n for n in (p.strip() for p in value.split(",")) if n and n not in self.choices]
        if unknown:
            self.fail(f"{unknown[0]!r} is not one of {', '.join(self.choices)}.", param, ctx)
        return value


class Integers(click.ParamType):
    """Comma-separated non-negative integers (layer ids, token counts); with ``increasing``,
    at least two, each at least 1 and larger than the one before (bucket edges).  ``keyword``,
    if given, is accepted as it is (``--context-lengths`` given bare)."""

    name = "integers"

    def __init__(self, increasing: bool = False, keyword: str | None = None):
        self.increasing, self.keyword = increasing, keyword

    def convert(self, value, param, ctx):
        if value == self.keyword:
            return value
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if not parts or not all(p.isdigit() for p in parts):
            self.fail(f"{value!r} is not comma-separated integers.", param, ctx)
        numbers = [int(p) for p in parts]
        if self.increasing and (
            len(numbers) < 2 or numbers[0] < 1 or any(a >= b for a, b in zip(numbers, numbers[1:]))
        ):
            self.fail(f"{value!r} is not two or more increasing numbers >= 1.", param, ctx)
        return value


class NameIsDir(click.ParamType):
    """``NAME=DIR``, both parts non-empty (qstream.eval.run.parse_variants checks DIR)."""

    name = "NAME=DIR"

    def convert(self, value, param, ctx):
        name, sep, path = value.partition("=")
        if not (name and sep and path):
            self.fail(f"{value!r} is not NAME=DIR.", param, ctx)
        return value
