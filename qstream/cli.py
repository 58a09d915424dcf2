"""The ``qstream`` command line: a thin click layer over the library, one command per
``qstream/commands/<name>.py`` (:data:`COMMANDS`).  No heavy library is imported here: help
screens read the plain names below, each equal to the library's own (tests/test_help.py).  A
:class:`~qstream.errors.QStreamError` becomes ``Error: <message>`` and exit status 1; a value
malformed on its own is a usage error, exit status 2 (docs/guarantees.md, "Exit statuses")."""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from qstream import __version__
from qstream.errors import QStreamError
from qstream.publish import check_parent, json_text, write_json_atomic
from qstream.serving import KV_CACHES, WEIGHT_FORMATS, Variant
from qstream.verification import LEGACY_NAMES

# --------------------------------------------------------------------------- the library's names

VARIANT_FORMATS = ("bf16", *WEIGHT_FORMATS)  # qstream.eval.vocabulary.VARIANT_FORMATS
SENSITIVITY_FORMAT = "nvfp4"  # qstream.eval.sensitivity.DEFAULT_FORMAT
DEFAULT_EDGES = "default"  # qstream.eval.settings.DEFAULT_EDGES: --context-lengths given bare
STATES_AUTO = "auto"  # qstream.eval.states.AUTO
STATES_FORMATS = ("qstream", "vllm", "specforge")  # qstream.eval.states.LAYOUTS
LAYER_CONVENTIONS = ("layer-output", "hidden-states-index")  # qstream.eval.states.CONVENTIONS
CAPTURE_DTYPES = ("float32", "bfloat16", "float16")  # qstream.capture.target.DTYPES
CAPTURE_EXPORTS = ("qstream", "vllm")  # qstream.eval.states.layouts.EXPORTS
CARD_FORMATS = ("md", "json", "html")  # qstream.card.build.FORMATS
VLLM_VERSION = "0.32.0"  # qstream.vllm.loader.VLLM_VERSION
CALIBRATION_BLOCKS = 32  # qstream.calibration.CALIBRATION_BLOCKS

# --------------------------------------------------------------------------- parameter types

DIRECTORY = click.Path(file_okay=False)  # a directory, or where one is to be
FILE = click.Path(dir_okay=False)  # a file, or where one is to be
COUNT = click.IntRange(min=1)


class TargetDir(click.Path):
    """``--target``: a transformers directory; a GGUF file, or a folder holding one, is refused
    with the command that converts it (:func:`qstream.checkpoint.target.refuse_gguf`)."""

    def convert(self, value, param, ctx):
        from qstream.checkpoint.target import refuse_gguf

        try:
            refuse_gguf(value)
        except QStreamError as exc:
            self.fail(str(exc).removeprefix(f"--target {value}: "), param, ctx)
        return super().convert(value, param, ctx)


class Choice(click.Choice):
    """click's Choice; a required option left out is one ``Error:`` line, not a list."""

    def get_missing_message(self, param, ctx):
        return f"Choose from {', '.join(map(str, self.choices))}."


class ModeChoice(Choice):
    """A verification mode's name; an old one (``LEGACY_NAMES``, hidden from the help) is taken
    with a ``Warning:`` line naming the new one."""

    def convert(self, value, param, ctx):
        mode = LEGACY_NAMES.get(value)
        if mode is not None and mode.name in self.choices:
            click.echo(f"Warning: {value!r} is deprecated; use {mode.name!r}", err=True)
            value = mode.name
        return super().convert(value, param, ctx)


class Device(click.ParamType):
    """``cpu``, ``cuda`` or ``cuda:N`` (qstream.device.resolve_device checks it exists)."""

    name = "device"

    def convert(self, value, param, ctx):
        if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
            self.fail(f"{value!r} is not cpu, cuda or cuda:N.", param, ctx)
        return value


class VariantTokens(click.ParamType):
    """Comma-separated serving configurations (qstream/serving.py): the tuple of tokens, or
    with ``one`` the one token."""

    name = "variants"

    def __init__(self, one: bool = False):
        self.one = one

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        tokens = tuple(n for n in (p.strip() for p in value.split(",")) if n)
        if self.one and len(tokens) != 1:
            self.fail(f"{value!r}: give one configuration token", param, ctx)
        for token in tokens:
            try:
                Variant.parse(token)
            except QStreamError as e:
                self.fail(str(e), param, ctx)
        return tokens[0] if self.one else tokens


class Integers(click.ParamType):
    """Comma-separated non-negative integers, returned as given; with ``increasing``, two or
    more, each at least 1 and above the one before.  ``keyword`` is taken as it is."""

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
    """``NAME=DIR``, both parts non-empty, returned as given."""

    name = "NAME=DIR"

    def convert(self, value, param, ctx):
        name, sep, path = value.partition("=")
        if not (name and sep and path):
            self.fail(f"{value!r} is not NAME=DIR.", param, ctx)
        return value


class FiniteRange(click.FloatRange):
    """A FloatRange that also refuses nan and inf."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


# --------------------------------------------------------------------------- commands


class _UserErrorsExit:
    """QStreamError becomes one line on stderr and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)  # type: ignore[misc]  # click.Command's, by the MRO
        except QStreamError as exc:
            click.echo(f"Error: {exc}", err=True)
            ctx.exit(1)


class ListOption(click.Option):
    """A repeatable option that also takes every value after it up to the next option, as
    argparse's ``nargs="+"`` (published quantization recipes are written so):
    ``--include_layers mlp.gate_proj mlp.up_proj``."""


class Command(_UserErrorsExit, click.Command):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Each list option written once per value (``--include_layers a --include_layers b``),
        then click's own parse."""
        lists = {s: p.opts[0] for p in self.params if isinstance(p, ListOption) for s in p.opts}
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
        out: list[str] = []
        rest = list(args)
        while rest:
            arg = rest.pop(0)
            out.append(arg)
            if arg == "--":
                out += rest
                break
            name, eq, _ = arg.partition("=")
            if name in valued and not eq and rest:
                out.append(rest.pop(0))
            if name not in lists:
                continue
            if not eq and rest:
                out.append(rest.pop(0))
            while rest and not rest[0].startswith("-"):
                out += [lists[name], rest.pop(0)]
        return super().parse_args(ctx, out)


# --------------------------------------------------------------------------- options

# torch's generators take seeds up to 2**64 - 1: a run adds small offsets to its seed (prompt i
# decodes with seed + i) or folds what it derives into that range (capture's stream_seed)
SEED_MAX = 2**63 - 1

# The options more than one command takes, each declared once; a command gives its own help and
# overrides (:func:`option`).  The sampling settings are one declaration for eval-drift and
# capture --generate: a capture made with the defaults is the target's own sample at the
# evaluation's defaults (docs/capture.md).
OPTIONS: dict[str, dict[str, Any]] = {
    "model": {"type": DIRECTORY},
    "target": {"type": TargetDir(file_okay=False)},
    "corpus": {"type": FILE},
    "formats": {"type": VariantTokens(), "default": ",".join(VARIANT_FORMATS)},
    "kv_cache_dtype": {
        "type": click.Choice(tuple(KV_CACHES)),
        "help": "The KV cache every variant but the reference serves with, as vLLM's "
        "--kv-cache-dtype (the draft inherits the target's); a variant's own kv= wins.",
    },
    "variant": {
        "type": NameIsDir(),
        "multiple": True,
        "metavar": "NAME=DIR",
        "help": "A quantized checkpoint to read back from disk; repeatable. It must be derived "
        "from --model (its unquantized tensors bit-identical).",
    },
    "allow_foreign_variant": {"is_flag": True},
    "no_integrity_check": {"is_flag": True},
    "include_layers": {"cls": ListOption, "multiple": True},
    "ignore_layers": {"cls": ListOption, "multiple": True, "help": "Modules never quantized."},
    "overwrite": {"is_flag": True},
    "dtype": {"type": click.Choice(CAPTURE_DTYPES)},
    # checked in spelling when parsed; that the device exists, by qstream.device.resolve_device
    "device": {"type": Device(), "default": "cpu", "metavar": "cpu|cuda|cuda:N"},
    # 0 .. SEED_MAX; outside, a usage error rather than an overflow inside torch
    "seed": {"type": click.IntRange(0, SEED_MAX), "default": 0},
    "temperature": {"type": FiniteRange(0, min_open=True), "default": 1.0},
    "top_p": {"type": FiniteRange(0, 1, min_open=True), "default": 1.0},
    "top_k": {"type": COUNT},
}


def option(name: str, help: str | None = None, **kwargs: Any):
    """A click option as ``--a-b`` and ``--a_b`` (docs/quantize.md: both are accepted), stored
    under ``a_b``: its :data:`OPTIONS` declaration with this command's ``help`` and ``kwargs``;
    a default other than None is shown."""
    declared = {**OPTIONS.get(name, {}), **kwargs}
    if help is not None:
        declared["help"] = help
    declared.setdefault("show_default", declared.get("default") is not None)
    spellings = dict.fromkeys(["--" + name.replace("_", "-"), "--" + name])
    return click.option(*spellings, name, **declared)


def list_option(name: str, **kwargs: Any):
    """A :class:`ListOption` (a :class:`Command`'s)."""
    return option(name, cls=ListOption, multiple=True, **kwargs)


def json_option():
    """``--json PATH``; a bad PATH (a directory, a missing or unwritable parent) fails when the
    options are parsed, not after the computation (docs/guarantees.md)."""

    def check(ctx: click.Context, param: click.Parameter, value: str | None):
        if value is not None and value != "-":
            try:
                if Path(value).is_dir():
                    raise QStreamError(f"--json {value}: is a directory, not a file")
                check_parent(value, "--json")
            except QStreamError as exc:
                raise click.ClickException(str(exc)) from None
        return value

    return click.option(
        "--json",
        "json_path",
        default=None,
        metavar="PATH",
        callback=check,
        help="Also write the results as JSON to PATH ('-' for standard output).",
    )


def write_json(data: Any, path: str | None) -> None:
    """Write ``data`` to ``path`` ('-' = stdout), whole or not at all (write_json_atomic)."""
    if path == "-":
        sys.stdout.write(json_text(data))
    elif path is not None:
        write_json_atomic(path, data, "--json")


def make_console(stderr: bool = False) -> Console:
    """A rich console for a command's tables: the terminal's width, or 200 columns when the
    output is redirected (rich would assume 80 and cut every cell; set COLUMNS to choose)."""
    out = Console(stderr=stderr)
    if out.is_terminal or "COLUMNS" in os.environ:
        return out
    return Console(stderr=stderr, width=200)


# --------------------------------------------------------------------------- the group

# name -> "module:attribute", imported only when that command runs or its help is shown
COMMANDS = {
    "formats": "qstream.commands.formats:formats",
    "quantize": "qstream.commands.quantize:quantize",
    "inspect": "qstream.commands.inspect:inspect",
    "verify": "qstream.commands.verify:verify",
    "synth": "qstream.commands.synth:synth",
    "convert-gguf": "qstream.commands.convert_gguf:convert_gguf",
    "capture": "qstream.commands.capture:capture",
    "eval-drift": "qstream.commands.eval_drift:eval_drift",
    "speculate": "qstream.commands.speculate:speculate",
    "card": "qstream.commands.card:card",
}


def _load(name: str) -> click.Command:
    module, attribute = COMMANDS[name].split(":")
    return getattr(importlib.import_module(module), attribute)


class LazyGroup(_UserErrorsExit, click.Group):
    command_class = Command

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return _load(name) if name in COMMANDS else None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qstream")
def cli() -> None:
    """Quantize speculative-decoding draft models and measure, honestly, what it costs them.

    \b
    qstream quantize --model_dir IN --output_dir OUT --quant_format fp8
    qstream eval-drift --regime heavy     each format's drift, built-in draft
    qstream card results.json --output CARD.md
    """


def main() -> None:
    cli(prog_name="qstream")


def quantize_main() -> None:
    """``qstream-quantize``: the quantize command on its own."""
    _load("quantize")(prog_name="qstream-quantize")
