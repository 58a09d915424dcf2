"""``qstream inspect DIR``: the click layer over
:func:`qstream.checkpoint.inspect.inspect_checkpoint`."""

from __future__ import annotations

import click
from rich.table import Table as RichTable

from qstream.cli import Command, json_option, make_console, write_json
from qstream.progress import step
from qstream.tablefit import Table


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
    from qstream.checkpoint.inspect import checkpoint_stats, inspect_checkpoint

    with step(f"reading {directory}" + (" and its weight statistics" if stats else "")):
        data = inspect_checkpoint(directory)
        if stats:
            data["weight_stats"] = checkpoint_stats(directory)
    # inspect reports NaN/Inf and exits 0, as verify does with its warnings; quantize refuses
    # such a weight when it is selected (docs/quantize.md)
    bad = [r for r in data["weight_stats"] if r["non_finite"]] if stats else []
    if bad:
        named = ", ".join(f"{r['name']} ({r['non_finite']} NaN/Inf)" for r in bad[:3])
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        click.echo(
            f"Warning: {len(bad)} weight(s) hold NaN or Inf, shown without statistics "
            f"(quantize refuses any it is to quantize): {named}{more}",
            err=True,
        )
    if json_path != "-":
        console = make_console()
        console.print(kinds_table(data, console.width))
        if stats:
            console.print(stats_table(data["weight_stats"], console.width))
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


def kinds_table(data: dict, width: int) -> RichTable:
    """The tensors by module kind; a long kind wraps between its dotted parts."""
    from qstream.units import human_size

    title = (
        f"{data['directory']}: {data['tensors']} tensors in {data['shards']} shard(s), "
        f"{data['params']:,} parameters, {human_size(data['bytes'])}"
    )
    rows = [
        [
            row["kind"],
            str(row["tensors"]),
            f"{row['params']:,}",
            ",".join(row["dtypes"]),
            str(row["shape"] or "varies"),
            human_size(row["bytes"]),
        ]
        for row in data["kinds"]
    ]
    return Table.of(title, KIND_COLUMNS, rows, align="lrrkrr").fitted(width)


KIND_COLUMNS = ("module kind", "tensors", "params", "dtype", "shape", "size")
STATS_COLUMNS = ("module kind", "std", "kurtosis", "max/std", "row spread", "col spread",
                 "non-finite")  # fmt: skip


def stats_table(rows: list[dict], width: int) -> RichTable:
    """Per module kind, the median over its tensors of each statistic (the JSON has every
    tensor).  Kurtosis 3 is Gaussian; spreads are p99/p50 of per-channel RMS (1 = uniform).
    A tensor holding NaN or Inf counts in "non-finite" and in no median."""
    from qstream.checkpoint.inspect import module_kind

    by_kind: dict[str, list[dict]] = {}
    for row in rows:
        kind = module_kind(row["name"]).removesuffix(".weight").removeprefix("layers.*.")
        by_kind.setdefault(kind, []).append(row)
    keys = ("std", "kurtosis", "max_over_std", "row_spread", "col_spread")
    table = []
    for kind, members in by_kind.items():
        cells = []
        for key in keys:
            values = sorted(m[key] for m in members if m.get(key) is not None and m[key] == m[key])
            cells.append(f"{values[len(values) // 2]:.3g}" if values else "-")
        non_finite = sum(m["non_finite"] for m in members)
        table.append([kind, *cells, f"{non_finite:,}"])
    title = "weight statistics (median over the finite tensors of a kind)"
    return Table.of(title, STATS_COLUMNS, table).fitted(width)
