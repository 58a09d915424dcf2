"""Small click helpers shared by the commands: both option spellings, options that take several
values, and the ``--json PATH|-`` convention.  No command logic lives here."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from qstream.clitypes import Device, NameIsDir
from qstream.errors import QStreamError
from qstream.publish import check_parent, json_text, write_json_atomic


class _UserErrorsExit:
    """Mixin for click commands: turn QStreamError into one line on stderr and exit status 1.
    This is the only place that happens (docs/quantize.md)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)  # type: ignore[misc]  # click.Command's, by the MRO
        except QStreamError as exc:
            click.echo(f"Error: {exc}", err=True)
            ctx.exit(1)


class ListOption(click.Option):
    """A repeatable option that also takes every value after it up to the next option, as
    argparse's ``nargs="+"`` does: ``--include_layers mlp.gate_proj mlp.up_proj``.  Published
    quantization recipes are written this way.  :class:`Command` gives it that reading."""


def _one_value_per_flag(args: list[str], lists: dict[str, str], valued: set[str]) -> list[str]:
    """``args`` with each list option (``lists``: its spellings -> the one to repeat) written
    once per value: ``--include_layers a b`` -> ``--include_layers a --include_layers b``.  The
    value right after the flag is its own whatever it looks like (click takes it so); more
    follow up to the next argument that starts with ``-`` (an option, or ``--``).  The value of
    any other option taking one (``valued``) is passed over as click will read it."""
    out: list[str] = []
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        out.append(arg)
        if arg == "--":
            return out + rest
        name, eq, _ = arg.partition("=")
        if name in valued and not eq and rest:
            out.append(rest.pop(0))
        if name not in lists:
            continue
        if not eq and rest:
            out.append(rest.pop(0))
        while rest and not rest[0].startswith("-"):
            out += [lists[name], rest.pop(0)]
    return out


class Command(_UserErrorsExit, click.Command):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Lists (:class:`ListOption`) rewritten one value per flag, then click's own parse."""
        lists = {
            spelling: param.opts[0]
            for param in self.params
            if isinstance(param, ListOption)
            for spelling in param.opts
        }
        valued = {
            spelling
            for param in self.params
            if isinstance(param, click.Option) and not isinstance(param, ListOption)
            if not param.is_flag and not param.count
            # an option whose value is optional (``is_flag=False, flag_value=...``) takes the
            # next argument only when it is no option, as click reads it: left to the loop
            if not isinstance(param.flag_value, str | int | float)
            for spelling in param.opts
        }
        return super().parse_args(ctx, _one_value_per_flag(args, lists, valued))


class Group(_UserErrorsExit, click.Group):
    command_class = Command


# Width of tables written to a file or a pipe: rich would otherwise assume 80 columns and cut
# every cell short; a terminal keeps its own width.
PIPE_WIDTH = 200


def make_console(stderr: bool = False) -> Console:
    """A rich console for a command's tables: the terminal's width, or PIPE_WIDTH when the
    output is redirected (set COLUMNS to choose another)."""
    out = Console(stderr=stderr)
    if out.is_terminal or "COLUMNS" in os.environ:
        return out
    return Console(stderr=stderr, width=PIPE_WIDTH)


def spellings(name: str) -> list[str]:
    """``model_dir`` -> ``["--model-dir", "--model_dir"]`` (docs/quantize.md: both are accepted)."""
    dashed, underscored = "--" + name.replace("_", "-"), "--" + name
    return [dashed] if dashed == underscored else [dashed, underscored]


def option(name: str, **kwargs: Any):
    """A click option reachable as ``--a-b`` and ``--a_b``, stored under ``a_b``."""
    return click.option(*spellings(name), name, **kwargs)


def count_option(name: str, default: int | None, help: str, minimum: int = 1, **kwargs: Any):
    """An integer option of at least ``minimum``; its default shown unless None."""
    return option(
        name,
        type=click.IntRange(min=minimum),
        default=default,
        show_default=default is not None,
        help=help,
        **kwargs,
    )


# torch's generators take seeds up to 2**64 - 1: a run adds small offsets to its seed (prompt i
# decodes with seed + i) or folds what it derives into that range (capture's stream_seed)
SEED_MAX = 2**63 - 1


def seed_option(help: str):
    """``--seed``: 0 .. SEED_MAX; outside, a usage error rather than an overflow inside torch."""
    type_ = click.IntRange(0, SEED_MAX)
    return option("seed", type=type_, default=0, show_default=True, help=help)


def flag_option(name: str, help: str):
    return option(name, is_flag=True, help=help)


class FiniteRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf (click's lets them through)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


# The sampling settings eval-drift evaluates at and capture --generate samples at: one type and
# default for both, so that a capture made with the defaults is the target's own sample at the
# evaluation's defaults (docs/capture.md).
SAMPLING_OPTIONS: dict[str, dict[str, Any]] = {
    "temperature": {"type": FiniteRange(0, min_open=True), "default": 1.0, "show_default": True},
    "top_p": {"type": FiniteRange(0, 1, min_open=True), "default": 1.0, "show_default": True},
    "top_k": {"type": click.IntRange(min=1), "default": None},
}


def sampling_option(name: str, help: str):
    """``--temperature`` / ``--top-p`` / ``--top-k`` as eval-drift and capture share them."""
    return option(name, help=help, **SAMPLING_OPTIONS[name])


def device_option(help: str):
    """``--device``: its spelling checked when parsed, its existence by
    :func:`qstream.device.resolve_device` when used."""
    return option(
        "device",
        type=Device(),
        default="cpu",
        show_default=True,
        metavar="cpu|cuda|cuda:N",
        help=help,
    )


def variant_option():
    """``--variant NAME=DIR``, a read-back checkpoint, as eval-drift and speculate share it."""
    return option(
        "variant",
        type=NameIsDir(),
        multiple=True,
        metavar="NAME=DIR",
        help="A quantized checkpoint to read back from disk; repeatable. It must be derived "
        "from --model (its unquantized tensors bit-identical).",
    )


def list_option(name: str, **kwargs: Any):
    """A :class:`ListOption` in both spellings (a :class:`Command`'s)."""
    return click.option(*spellings(name), name, cls=ListOption, multiple=True, **kwargs)


def _check_json_path(ctx: click.Context, param: click.Parameter, value: str | None):
    """``--json PATH`` is refused when the options are parsed (docs/guarantees.md), so that a bad
    path fails at once rather than after the computation: a directory, or a missing or
    unwritable parent.  ClickException prints one ``Error:`` line, exit 1."""
    if value is not None and value != "-":
        try:
            if Path(value).is_dir():
                raise QStreamError(f"--json {value}: is a directory, not a file")
            check_parent(value, "--json")
        except QStreamError as exc:
            raise click.ClickException(str(exc)) from None
    return value


def json_option():
    return click.option(
        "--json",
        "json_path",
        default=None,
        metavar="PATH",
        callback=_check_json_path,
        help="Also write the results as JSON to PATH ('-' for standard output).",
    )


def write_json(data: Any, path: str | None) -> None:
    """Write ``data`` to ``path`` ('-' = stdout), whole or not at all (write_json_atomic)."""
    if path == "-":
        sys.stdout.write(json_text(data))
    elif path is not None:
        write_json_atomic(path, data, "--json")
