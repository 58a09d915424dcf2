"""The ``qstream`` command line: a thin click layer over the library.

Every command lives in ``qstream/commands/<name>.py`` and is registered below.  Commands use
``cliutil.Command``, whose ``invoke`` is the one place where a
:class:`~qstream.errors.QStreamError` becomes ``Error: <message>`` on stderr and exit status 1
(docs/quantize.md): commands never print tracebacks for user mistakes.
"""

from __future__ import annotations

import importlib

import click

from qstream import __version__
from qstream.cliutil import Group

# name -> "module:attribute"; a command's module is imported only when that command runs or its
# help is shown.  A command module imports the library (torch, scipy, ...) inside its callback
# and takes its options' choices from qstream.clichoices, so that `qstream --help` (which
# imports every command module for its summary) and `qstream COMMAND --help` load none of it
# (tests/test_help.py, evals/bench_help.py).
COMMANDS = {
    "formats": "qstream.commands.formats:formats",
    "quantize": "qstream.commands.quantize:quantize",
    "inspect": "qstream.commands.inspect:inspect",
    "verify": "qstream.commands.verify:verify",
    "synth": "qstream.commands.synth:synth",
    "capture": "qstream.commands.capture:capture",
    "eval-drift": "qstream.commands.eval_drift:eval_drift",
    "speculate": "qstream.commands.speculate:speculate",
    "card": "qstream.commands.card:card",
}


class LazyGroup(Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attribute = target.split(":")
        return getattr(importlib.import_module(module), attribute)


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
    """Entry point of ``qstream-quantize``: the quantize command on its own."""
    from qstream.commands.quantize import quantize

    quantize(prog_name="qstream-quantize")
