"""``qstream verify DIR``: the click layer over :func:`qstream.checkpoint.verify.verify_checkpoint`."""

from __future__ import annotations

from dataclasses import asdict

import click

from qstream.checkpoint.verify import verify_checkpoint
from qstream.cliutil import Command, json_option, option, write_json
from qstream.errors import QStreamError


@click.command(cls=Command)
@click.argument("directory", metavar="DIR")
@option(
    "tensor_parallel_size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="The tensor-parallel size vLLM will serve the checkpoint at.",
)
@option(
    "target_layers",
    type=click.IntRange(min=0),
    default=None,
    metavar="L",
    help="The target's layer count, which offsets a draft's runtime layer names "
    "(default: config.json's target_num_hidden_layers).",
)
@option(
    "deep",
    is_flag=True,
    help="Also dequantize every quantized weight and require finite "
    "values (reads the whole checkpoint).",
)
@json_option()
def verify(
    directory: str,
    tensor_parallel_size: int,
    target_layers: int | None,
    deep: bool,
    json_path: str | None,
) -> None:
    """Check a quantized checkpoint as vLLM will load it: one config group, each quantized
    module's stored tensors (dtypes, shapes, sane scale values), fused groups whole (NVFP4: one
    shared global scale), the index, and with --deep a dequantize round trip.  For a DSpark draft, vLLM's decision is
    replayed for every runtime Linear layer at --tensor-parallel-size (docs/vllm.md).  Exits 1
    with one line per violation.  Example: qstream verify draft-nvfp4 --tensor-parallel-size 8
    """
    report = verify_checkpoint(directory, tensor_parallel_size, target_layers, deep)
    write_json({**asdict(report), "ok": report.ok}, json_path)
    for warning in report.warnings:
        click.echo(f"Warning: {warning}", err=True)
    if report.ok:
        if json_path != "-":
            layers = f", L={report.target_layers}" if report.target_layers is not None else ""
            click.echo(
                f"OK: {report.directory}: {report.quant_format}, "
                f"{len(report.modules_quantized)} quantized and "
                f"{len(report.modules_ignored)} ignored modules; vLLM rules "
                f"{report.serving_profile} at tensor_parallel_size "
                f"{report.tensor_parallel_size}{layers}"
            )
        return
    for problem in report.problems:
        click.echo(f"  {problem}", err=True)
    raise QStreamError(f"{report.directory}: {len(report.problems)} problem(s), listed above")
