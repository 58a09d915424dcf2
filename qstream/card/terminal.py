"""What ``qstream eval-drift`` prints: the card's tables (qstream/card/tables.py) fitted to at
most MAX_WIDTH columns, never split or cut (docs/guarantees.md, "Shown"), variants by bare name."""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console
from rich.text import Text

from qstream.card.document import Code, Part
from qstream.card.results import ResultsSet, collect_results
from qstream.card.serving import conditions_tables
from qstream.card.tables import (
    agreement_table,
    all_acceptance_tables,
    context_sweep_table,
    full_metrics_table,
    regime_order,
    sensitivity_parts,
    variant_label,
    variant_order,
)
from qstream.tablefit import EDGES, FRAME, Cell, Table, column_widths

SOURCE = "(this run)"  # where in-memory results came from, for the results set's messages
MAX_WIDTH = 100  # columns a terminal table may take (--wide: no limit)


def report_parts(rs: ResultsSet) -> list[Part]:
    """Per regime the metrics, agreement and studies; then acceptance and serving conditions."""
    parts: list[Part] = []
    for regime in regime_order(rs):
        parts += [full_metrics_table(rs, regime), agreement_table(rs, regime)]
        sections = rs.sections.get(regime, {})
        if "sensitivity" in sections:
            parts += sensitivity_parts(rs, regime)
        if "context_sweep" in sections:
            parts.append(context_sweep_table(rs, regime))
    return parts + all_acceptance_tables(rs) + conditions_tables(rs)


def short_names(rs: ResultsSet) -> dict[str, str]:
    """Each variant's card label -> its bare name, where the two differ."""
    labels = {variant_label(rs, v): v for v in variant_order(rs)}
    return {label: name for label, name in labels.items() if label != name}


def terminal_table(table: Table, rs: ResultsSet, width: int) -> tuple[Table, int]:
    """The card's ``table`` as the terminal shows it at ``width``, and how many leading columns
    are grouped: the labels but the last.  The agreement table is grouped by measure (then
    variant); a table of variant columns too wide with its labels unwrapped turns into one row
    per label row and variant: the other columns, ``variant`` and ``value``."""
    names = short_names(rs)  # every variant label, a header or a cell, by its bare name
    rows = [[Cell(names.get(c.text, c.text), c.data) for c in row] for row in table.rows]
    table = replace(table, columns=[names.get(c, c) for c in table.columns], rows=rows)
    variants = [v for v in variant_order(rs) if v in table.columns]
    labels = len(table.align) - len(table.align.lstrip("l"))
    if table.key.startswith("agreement_"):
        measures = list(dict.fromkeys(row[1].text for row in table.rows))
        swap = [1, 0, *range(2, len(table.columns))]
        rows = sorted(table.rows, key=lambda row: measures.index(row[1].text))
        table = replace(table, columns=[table.columns[i] for i in swap],
                        rows=[[row[i] for i in swap] for row in rows],
                        align="".join(table.align[i] for i in swap))  # fmt: skip
        return table, labels - 1
    columns, texts = table.layout(), table.texts()
    widths = column_widths(columns, texts, width)
    natural = column_widths(columns, texts, 10**6)
    fits = sum(widths) + FRAME * len(widths) + EDGES <= width
    if len(variants) > 1 and not (widths[:labels] == natural[:labels] and fits):
        keep = [i for i, c in enumerate(table.columns) if c not in variants]
        melt = [i for i, c in enumerate(table.columns) if c in variants]
        rows = [[*(row[i] for i in keep), Cell(table.columns[j]), row[j]]
                for row in table.rows for j in melt]  # fmt: skip
        header = [*(table.columns[i] for i in keep), "variant", "value"]
        align = "".join(table.align[i] for i in keep) + "lr"
        return replace(table, columns=header, rows=rows, align=align), len(header) - 2
    return table, max(0, labels - 1)


def print_report(console: Console, results: dict, wide: bool = False) -> None:
    """Print :func:`report_parts` of eval-drift ``results`` at most MAX_WIDTH wide (``wide``: the
    console's width), after a note where the variants' quantized sets differ."""
    width = console.width if wide else min(console.width, MAX_WIDTH)
    rs = collect_results([(results, SOURCE)])
    shortened = short_names(rs)
    if shortened:
        counts = ", ".join(
            f"{name} {label[len(name) :].strip(' ()').split(';')[0]}"
            for label, name in shortened.items()
        )
        note = (
            f"Note: the variants do not quantize the same tensors ({counts}); the tables below "
            "name them by name only."
        )
        console.print(Text(note), width=width)
    for n, part in enumerate(report_parts(rs)):
        if isinstance(part, Table):
            if n or shortened:
                console.print()
            console.print(Text(part.caption), width=width)
            shown, grouped = terminal_table(part, rs, width)
            console.print(shown.fitted(width, grouped, titled=False))
        else:
            console.print(Text(part.text if isinstance(part, Code) else str(part)), width=width)
