"""``qstream inspect DIR``: the click layer over :func:`qstream.checkpoint.inspect.inspect_checkpoint`."""

from __future__ import annotations

import click
from rich.table import Table

from qstream.cliutil import Command, json_option, make_console, write_json


@click.command(cls=Command)
@click.argument("directory", metavar="DIR")
@click.option(
    "--stats/--no-stats",
    default=True,
    show_default=True,
    help="Weight statistics (kurtosis, outliers, channel spread) per module kind.",
)
@json_option()
def inspect(directory: str, stats: bool, json_path: str | None) -> None:
    """Show a checkpoint's tensors by module kind: count, parameters, dtype, size on disk,
    weight statistics, and its quantization config if it has one.

    Example: qstream inspect draft-fp8
    """
    # here, not above: `qstream inspect --help` loads no torch
    from qstream.checkpoint.inspect import inspect_checkpoint
    from qstream.model.stats import checkpoint_stats
    from qstream.units import human_size

    data = inspect_checkpoint(directory)
    if stats:
        data["weight_stats"] = checkpoint_stats(directory)
    if json_path != "-":
        console = make_console()
        table = Table(
            title=f"{data['directory']}: {data['tensors']} tensors in "
            f"{data['shards']} shard(s), {data['params']:,} parameters, "
            f"{human_size(data['bytes'])}"
        )
        for col in ("module kind", "tensors", "parameters", "dtype", "shape", "size"):
            table.add_column(col, justify="left" if col in ("module kind", "dtype") else "right")
        for row in data["kinds"]:
            table.add_row(
                row["kind"],
                str(row["tensors"]),
                f"{row['params']:,}",
                ",".join(row["dtypes"]),
                str(row["shape"] or "varies"),
                human_size(row["bytes"]),
            )
        console.print(table)
        if stats:
            console.print(_stats_table(data["weight_stats"]))
        qconfig = data["quantization_config"]
        if isinstance(qconfig, dict):
            groups = qconfig.get("config_groups") or {}
            console.print(
                f"quantization_config: format {qconfig.get('format')!r}, "
                f"{len(groups)} group(s), targets "
                f"{[g.get('targets') for g in groups.values()]}, "
                f"{len(qconfig.get('ignore') or [])} ignored modules, "
                f"version {qconfig.get('version')!r}"
            )
        else:
            console.print("not quantized (no quantization_config)")
    write_json(data, json_path)


def _stats_table(rows: list[dict]) -> Table:
    """Per module kind, the median over its tensors of each statistic (the JSON has every
    tensor).  Kurtosis 3 is Gaussian; spreads are p99/p50 of per-channel RMS (1 = uniform)."""
    from qstream.checkpoint.inspect import module_kind

    by_kind: dict[str, list[dict]] = {}
    for row in rows:
        kind = module_kind(row["name"]).removesuffix(".weight").removeprefix("layers.*.")
        by_kind.setdefault(kind, []).append(row)
    table = Table(title="weight statistics (median over the tensors of a kind)")
    for col in ("module kind", "std", "kurtosis", "max/std", "row spread", "col spread"):
        table.add_column(col, justify="left" if col == "module kind" else "right")
    keys = ("std", "kurtosis", "max_over_std", "row_spread", "col_spread")
    for kind, members in by_kind.items():
        cells = []
        for key in keys:
            values = sorted(m[key] for m in members if key in m and m[key] == m[key])
            cells.append(f"{values[len(values) // 2]:.3g}" if values else "-")
        table.add_row(kind, *cells)
    return table
