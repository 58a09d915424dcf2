"""The ``qstream`` command line: a thin click layer over the library.

Every command lives in ``qstream/commands/<name>.py`` and is registered below.  Commands use
``cliutil.Command``, whose ``invoke`` is the one place where a
:class:`~qstream.errors.QStreamError` becomes ``Error: <message>`` on stderr and exit status 1
(DESIGN.md section 2): commands never print tracebacks for user mistakes.
"""

from __future__ import annotations

import click

from qstream import __version__
from qstream.cliutil import Group


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qstream")
def cli() -> None:
    """Quantize speculative-decoding draft models and measure, honestly, what it costs them.

    \b
    qstream formats                      the number formats and their weight SNR
    qstream quantize --model_dir IN --output_dir OUT --quant_format fp8
    """


def _register() -> None:
    from qstream.commands.card import card
    from qstream.commands.eval_drift import eval_drift
    from qstream.commands.formats import formats
    from qstream.commands.inspect import inspect
    from qstream.commands.quantize import quantize
    from qstream.commands.synth import synth
    from qstream.commands.verify import verify

    for command in (formats, quantize, inspect, verify, synth, eval_drift, card):
        cli.add_command(command)


_register()


def main() -> None:
    cli(prog_name="qstream")


def quantize_main() -> None:
    """Entry point of ``qstream-quantize``: the quantize command on its own."""
    from qstream.commands.quantize import quantize

    quantize(prog_name="qstream-quantize")
