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
from qstream.card.tables import (
    acceptance_table,
    acceptance_verifiers,
    agreement_table,
    context_sweep_table,
    full_metrics_table,
    regime_order,
    sensitivity_table,
)

SOURCE = "(this run)"  # where in-memory results came from, for the results set's messages


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
    parts += [acceptance_table(rs, verifier) for verifier in acceptance_verifiers(rs)]
    return parts


def rich_table(table: Table) -> RichTable:
    """A card table as a rich table: same caption, columns, alignment and cell text."""
    out = RichTable(title=Text(table.caption))
    for column, align in zip(table.columns, table.align):
        out.add_column(Text(column), justify="left" if align == "l" else "right")
    for row in table.rows:
        out.add_row(*(Text(cell.text) for cell in row))
    return out


def print_report(console: Console, results: dict) -> None:
    """Print :func:`report_parts` of eval-drift ``results`` held in memory."""
    for part in report_parts(collect_results([(results, SOURCE)])):
        if isinstance(part, Table):
            console.print(rich_table(part))
        elif isinstance(part, Code):
            console.print(Text(part.text))
        else:
            console.print(Text(str(part)))
