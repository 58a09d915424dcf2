"""The tables ``qstream eval-drift`` prints: the card's own table objects (qstream/card/tables.py)
built from the run's results in memory, rendered with rich for a terminal instead of markdown.

>>> print_report(make_console(), evaluate_drift(model_dir, settings, corpus))
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table as RichTable
from rich.text import Text

from qstream.card.build import suggested_command
from qstream.card.document import Code, Part, Table
from qstream.card.results import ResultsSet, collect_results
from qstream.card.study_tables import (
    acceptance_tables,
    acceptance_verifiers,
    context_sweep_table,
    sensitivity_table,
)
from qstream.card.tables import agreement_table, full_metrics_table, regime_order

SOURCE = "(this run)"  # where in-memory results came from, for the results set's messages
MAX_WIDTH = 100  # columns a terminal table may take; wider ones are split (--wide: not split)
_CELL_FRAME = 3  # a rich cell's padding (1 + 1) and its left border
LABEL_MAX = 30  # a split table's label columns wrap at this many characters


def report_parts(rs: ResultsSet) -> list[Part]:
    """Per regime every metric and the agreement by position, the sensitivity steps and context
    buckets where measured; then the acceptance per verifier."""
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
    return parts


def _widths(table: Table) -> list[int]:
    """Each column's rendered width: its longest line (header or cell) plus the cell frame."""
    return [
        max(
            len(line)
            for text in (column, *(row[i].text for row in table.rows))
            for line in (text.splitlines() or [""])
        )
        + _CELL_FRAME
        for i, column in enumerate(table.columns)
    ]


def split_table(table: Table, width: int = MAX_WIDTH) -> list[Table]:
    """``table`` as tables of at most ``width`` columns: its leading label columns (``l``)
    repeated in each, the value columns shared out in order; one table if it fits already.
    A single value column wider than the rest of the width stays alone (its cells wrap)."""
    widths = _widths(table)
    if sum(widths) + 1 <= width:
        return [table]
    n_labels = len(table.align) - len(table.align.lstrip("l")) or 1
    label_width = sum(min(w, LABEL_MAX + _CELL_FRAME) for w in widths[:n_labels]) + 1
    groups: list[list[int]] = [[]]
    for i in range(n_labels, len(table.columns)):
        if groups[-1] and label_width + sum(widths[j] for j in groups[-1]) + widths[i] > width:
            groups.append([])
        groups[-1].append(i)
    return [
        _subtable(
            table, list(range(n_labels)) + group, f" ({n}/{len(groups)})" if len(groups) > 1 else ""
        )
        for n, group in enumerate(groups, 1)
    ]


def _subtable(table: Table, keep: list[int], suffix: str) -> Table:
    return Table(
        table.caption + suffix,
        [table.columns[i] for i in keep],
        [[row[i] for i in keep] for row in table.rows],
        table.key,
        "".join(table.align[i] for i in keep),
    )


def rich_table(table: Table, label_max: int | None = None) -> RichTable:
    """A card table as a rich table: same caption, columns, alignment and cell text; a cell
    too wide for the console wraps (``fold``) rather than being cut to ``0.9…``; label
    columns wrap at ``label_max`` characters when given."""
    out = RichTable(title=Text(table.caption))
    for column, align in zip(table.columns, table.align):
        out.add_column(
            Text(column),
            justify="left" if align == "l" else "right",
            overflow="fold",
            max_width=label_max if align == "l" else None,
        )
    for row in table.rows:
        out.add_row(*(Text(cell.text) for cell in row))
    return out


def print_report(console: Console, results: dict, wide: bool = False) -> None:
    """Print :func:`report_parts` of eval-drift ``results`` held in memory; tables wider than
    the console (at most MAX_WIDTH) are split unless ``wide``."""
    width = min(console.width, MAX_WIDTH)
    for part in report_parts(collect_results([(results, SOURCE)])):
        if isinstance(part, Table):
            pieces = [part] if wide else split_table(part, width)
            for piece in pieces:
                console.print(rich_table(piece, LABEL_MAX if piece is not part else None))
        elif isinstance(part, Code):
            console.print(Text(part.text))
        else:
            console.print(Text(str(part)))
