"""``qstream verify DIR``: the click layer over :func:`qstream.checkpoint.verify.verify_checkpoint`."""

from __future__ import annotations

from dataclasses import asdict

import click

from qstream.checkpoint.verify import verify_checkpoint
from qstream.cliutil import Command, json_option, write_json
from qstream.errors import QStreamError


@click.command(cls=Command)
@click.argument("directory", metavar="DIR")
@json_option()
def verify(directory: str, json_path: str | None) -> None:
    """Check a quantized checkpoint as vLLM will load it: one config group, each quantized
    module's stored tensors (dtypes, shapes), targets/ignore accounting for every weight,
    fused groups whole (NVFP4: one shared global scale), the index, and a dequantize round
    trip.  Exits 1 listing the problems.  Example: qstream verify draft-nvfp4
    """
    report = verify_checkpoint(directory)
    write_json({**asdict(report), "ok": report.ok}, json_path)
    if report.ok:
        if json_path != "-":
            click.echo(f"OK: {report.directory}: {report.quant_format}, "
                       f"{len(report.modules_quantized)} quantized and "
                       f"{len(report.modules_ignored)} ignored modules")
        return
    for problem in report.problems:
        click.echo(f"  {problem}", err=True)
    raise QStreamError(f"{report.directory}: {len(report.problems)} problem(s), listed above")
