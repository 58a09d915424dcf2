"""What ``qstream eval-drift`` prints: the card's tables (qstream/card/tables.py) fitted to at
most MAX_WIDTH columns, never split or cut (docs/guarantees.md, "Shown"): variants by their bare
name, a table too wide for a column per variant turned into a row per variant, the agreement table
grouped by measure.

>>> print_report(make_console(), evaluate_drift(settings))
"""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console
from rich.table import Table as RichTable
from rich.text import Text

from qstream.card.document import Code, Part
from qstream.card.results import ResultsSet, collect_results
from qstream.card.serving import conditions_tables
from qstream.card.tables import (
    acceptance_tables,
    acceptance_verifiers,
    agreement_table,
    context_sweep_table,
    full_metrics_table,
    regime_order,
    sensitivity_table,
    suggested_command,
    variant_label,
    variant_order,
)
from qstream.tablefit import EDGES, FRAME, Cell, Table, column_widths

SOURCE = "(this run)"  # where in-memory results came from, for the results set's messages
MAX_WIDTH = 100  # columns a terminal table may take (--wide: no limit)


def report_parts(rs: ResultsSet) -> list[Part]:
    """Per regime every metric and the agreement by position, the sensitivity steps and context
    buckets where measured; then the acceptance per verifier and the serving conditions."""
    parts: list[Part] = []
    for regime in regime_order(rs):
        parts += [full_metrics_table(rs, regime), agreement_table(rs, regime)]
        sections = rs.sections.get(regime, {})
        if "sensitivity" in sections:
            parts += [sensitivity_table(rs, regime), suggested_command(rs, regime)]
        if "context_sweep" in sections:
            parts.append(context_sweep_table(rs, regime))
    for verifier in acceptance_verifiers(rs):
        parts += acceptance_tables(rs, verifier)
    return parts + conditions_tables(rs)


def short_names(rs: ResultsSet) -> dict[str, str]:
    """Each variant's card label -> its bare name, where the two differ."""
    labels = {variant_label(rs, v): v for v in variant_order(rs)}
    return {label: name for label, name in labels.items() if label != name}


def variants_note(rs: ResultsSet) -> str | None:
    """One line saying what the bare names leave out: the variants' quantized sets differ."""
    shortened = short_names(rs)
    if not shortened:
        return None
    counts = ", ".join(
        f"{name} {label[len(name) :].strip(' ()').split(';')[0]}"
        for label, name in shortened.items()
    )
    return (
        f"Note: the variants do not quantize the same tensors ({counts}); the tables below "
        "name them by name only."
    )


def _rename(table: Table, names: dict[str, str]) -> Table:
    """``table`` with every variant label (a header or a cell) replaced by the bare name."""
    rows = [
        [Cell(names.get(cell.text, cell.text), cell.data) for cell in row] for row in table.rows
    ]
    return replace(table, columns=[names.get(c, c) for c in table.columns], rows=rows)


def _n_labels(table: Table) -> int:
    """The leading label columns: left-aligned, before the first number."""
    return len(table.align) - len(table.align.lstrip("l"))


def _fits_unwrapped(table: Table, width: int) -> bool:
    """The table fits ``width`` with its label columns at their natural width."""
    columns, rows = table.layout(), table.texts()
    widths = column_widths(columns, rows, width)
    natural = column_widths(columns, rows, 10**6)
    labels = _n_labels(table)
    return (
        widths[:labels] == natural[:labels] and sum(widths) + FRAME * len(widths) + EDGES <= width
    )


def by_variant(table: Table, variants: list[str]) -> Table:
    """One row per label row and variant column: the columns naming a variant become a
    ``variant`` column and a ``value`` column, the other columns are kept before them."""
    keep = [i for i, c in enumerate(table.columns) if c not in variants]
    melt = [i for i, c in enumerate(table.columns) if c in variants]
    rows = [
        [*(row[i] for i in keep), Cell(table.columns[j]), row[j]]
        for row in table.rows
        for j in melt
    ]
    columns = [*(table.columns[i] for i in keep), "variant", "value"]
    return replace(
        table, columns=columns, rows=rows, align="".join(table.align[i] for i in keep) + "lr"
    )


def measure_first(table: Table) -> Table:
    """The agreement table grouped by measure (then variant, as the card orders them)."""
    order = list(dict.fromkeys(row[1].text for row in table.rows))
    rows = sorted(table.rows, key=lambda row: order.index(row[1].text))
    swap = [1, 0, *range(2, len(table.columns))]
    return replace(table, columns=[table.columns[i] for i in swap],
                   rows=[[row[i] for i in swap] for row in rows],
                   align="".join(table.align[i] for i in swap))  # fmt: skip


def terminal_table(table: Table, rs: ResultsSet, width: int) -> tuple[Table, int]:
    """The card's ``table`` as the terminal shows it at ``width``, and how many leading columns
    are grouped: the labels but the last (one row per variant: every column before it)."""
    table = _rename(table, short_names(rs))
    variants = [v for v in variant_order(rs) if v in table.columns]
    if table.key.startswith("agreement_"):
        table = measure_first(table)
    elif len(variants) > 1 and not _fits_unwrapped(table, width):
        table = by_variant(table, variants)
        return table, len(table.columns) - 2
    return table, max(0, _n_labels(table) - 1)


def render(table: Table, rs: ResultsSet, width: int) -> RichTable:
    """The card's ``table`` as a rich table that fits ``width``."""
    shown, grouped = terminal_table(table, rs, width)
    return shown.fitted(width, grouped, titled=False)


def print_report(console: Console, results: dict, wide: bool = False) -> None:
    """Print :func:`report_parts` of eval-drift ``results`` at the console's width (at most
    MAX_WIDTH; ``wide``: the console's), a blank line before each table's caption."""
    width = console.width if wide else min(console.width, MAX_WIDTH)
    rs = collect_results([(results, SOURCE)])
    note = variants_note(rs)
    if note is not None:
        console.print(Text(note), width=width)
    for n, part in enumerate(report_parts(rs)):
        if isinstance(part, Table):
            if n or note is not None:
                console.print()
            console.print(Text(part.caption), width=width)
            console.print(render(part, rs, width))
        else:
            console.print(Text(part.text if isinstance(part, Code) else str(part)), width=width)
