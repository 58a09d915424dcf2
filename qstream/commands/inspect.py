"""``qstream inspect DIR``: the click layer over :func:`qstream.checkpoint.inspect.inspect_checkpoint`."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from qstream.checkpoint.inspect import inspect_checkpoint
from qstream.cliutil import Command, json_option, write_json

GIB = 1 << 30


@click.command(cls=Command)
@click.argument("directory", metavar="DIR")
@json_option()
def inspect(directory: str, json_path: str | None) -> None:
    """Show a checkpoint's tensors by module kind: count, parameters, dtype, size on disk,
    and its quantization config if it has one.  Example: qstream inspect draft-fp8
    """
    data = inspect_checkpoint(directory)
    if json_path != "-":
        console = Console()
        table = Table(title=f"{data['directory']}: {data['tensors']} tensors in "
                      f"{data['shards']} shard(s), {data['params']:,} parameters, "
                      f"{data['bytes'] / GIB:.3f} GiB")
        for col in ("module kind", "tensors", "parameters", "dtype", "shape", "MiB"):
            table.add_column(col, justify="left" if col in ("module kind", "dtype") else "right")
        for row in data["kinds"]:
            table.add_row(row["kind"], str(row["tensors"]), f"{row['params']:,}",
                          ",".join(row["dtypes"]), str(row["shape"] or "varies"),
                          f"{row['bytes'] / (1 << 20):.2f}")
        console.print(table)
        qconfig = data["quantization_config"]
        if isinstance(qconfig, dict):
            groups = qconfig.get("config_groups") or {}
            console.print(f"quantization_config: format {qconfig.get('format')!r}, "
                          f"{len(groups)} group(s), targets "
                          f"{[g.get('targets') for g in groups.values()]}, "
                          f"{len(qconfig.get('ignore') or [])} ignored modules, "
                          f"version {qconfig.get('version')!r}")
        else:
            console.print("not quantized (no quantization_config)")
    write_json(data, json_path)
