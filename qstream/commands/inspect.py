"""``qstream inspect DIR``: the click layer over :func:`qstream.checkpoint.inspect.inspect_checkpoint`."""

from __future__ import annotations

import click
from rich.table import Table

from qstream.checkpoint.inspect import inspect_checkpoint, module_kind
from qstream.cliutil import Command, json_option, make_console, write_json
from qstream.model.stats import checkpoint_stats
from qstream.units import human_size


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
    data = inspect_checkpoint(directory)
    if stats:
        data["weight_stats"] = checkpoint_stats(directory)
        _warn_non_finite(data["weight_stats"])
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


def _warn_non_finite(rows: list[dict]) -> None:
    """One ``Warning:`` line naming the weights that hold NaN or Inf.  inspect reports and exits
    0, as verify does with its warnings; quantize refuses such a weight when it is selected
    (docs/quantize.md)."""
    bad = [r for r in rows if r["non_finite"]]
    if not bad:
        return
    named = ", ".join(f"{r['name']} ({r['non_finite']} NaN/Inf)" for r in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    click.echo(
        f"Warning: {len(bad)} weight(s) hold NaN or Inf, shown without statistics "
        f"(quantize refuses any it is to quantize): {named}{more}",
        err=True,
    )


def _stats_table(rows: list[dict]) -> Table:
    """Per module kind, the median over its tensors of each statistic (the JSON has every
    tensor).  Kurtosis 3 is Gaussian; spreads are p99/p50 of per-channel RMS (1 = uniform).
    A tensor holding NaN or Inf counts in "non-finite" and in no median."""
    by_kind: dict[str, list[dict]] = {}
    for row in rows:
        kind = module_kind(row["name"]).removesuffix(".weight").removeprefix("layers.*.")
        by_kind.setdefault(kind, []).append(row)
    table = Table(title="weight statistics (median over the finite tensors of a kind)")
    columns = ("module kind", "std", "kurtosis", "max/std", "row spread", "col spread")
    for col in (*columns, "non-finite"):
        table.add_column(col, justify="left" if col == "module kind" else "right")
    keys = ("std", "kurtosis", "max_over_std", "row_spread", "col_spread")
    for kind, members in by_kind.items():
        cells = []
        for key in keys:
            values = sorted(m[key] for m in members if m.get(key) is not None and m[key] == m[key])
            cells.append(f"{values[len(values) // 2]:.3g}" if values else "-")
        non_finite = sum(m["non_finite"] for m in members)
        table.add_row(kind, *cells, f"[bold red]{non_finite:,}[/]" if non_finite else "0")
    return table
