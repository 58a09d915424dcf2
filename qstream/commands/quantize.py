"""``qstream quantize`` / ``qstream-quantize`` (being built: see the quantize issue)."""

from __future__ import annotations

import click

from qstream.cliutil import Command, greedy_option, option
from qstream.errors import QStreamError


@click.command(cls=Command)
@option("model_dir", required=True, type=click.Path(file_okay=False), help="Input checkpoint.")
@option("output_dir", required=True, type=click.Path(file_okay=False), help="Output directory.")
@option("quant_format", required=True, type=click.Choice(["fp8", "mxfp4", "nvfp4"]))
@greedy_option("include_layers", help="Modules to quantize (patterns).")
@greedy_option("ignore_layers", help="Modules never to quantize (patterns).")
@option("device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@option("workers", type=int, default=1, show_default=True)
def quantize(**kwargs) -> None:
    """Write a weight-only FP8 / MXFP4 / NVFP4 checkpoint in the compressed-tensors layout."""
    raise QStreamError("quantize is not yet available in this version")
