"""The ``qstream`` command line: a thin click layer over the library.

Every command lives in ``qstream/commands/<name>.py`` and is registered below.  This is the one
place where a :class:`~qstream.errors.QStreamError` becomes ``Error: <message>`` on stderr and
exit status 1 (DESIGN.md section 2): commands never print tracebacks for user mistakes.
"""

from __future__ import annotations

import click

from qstream import __version__
from qstream.errors import QStreamError


class _UserErrorsExit:
    """Mixin for click commands: turn QStreamError into one line and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except QStreamError as exc:
            click.echo(f"Error: {exc}", err=True)
            ctx.exit(1)


class Command(_UserErrorsExit, click.Command):
    pass


class Group(_UserErrorsExit, click.Group):
    command_class = Command


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qstream")
def cli() -> None:
    """Quantize speculative-decoding draft models and measure, honestly, what it costs them.

    \b
    qstream formats                      the number formats and their weight SNR
    qstream quantize --model_dir IN --output_dir OUT --quant_format fp8
    """


def _register() -> None:
    from qstream.commands.formats import formats
    from qstream.commands.quantize import quantize

    for command in (formats, quantize):
        cli.add_command(command)


_register()


def main() -> None:
    cli(prog_name="qstream")


def quantize_main() -> None:
    """Entry point of ``qstream-quantize``: the quantize command on its own."""
    from qstream.commands.quantize import quantize

    quantize(prog_name="qstream-quantize")
