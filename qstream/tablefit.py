"""qstream's one kind of table: cells keeping the text shown and the JSON value behind it,
rendered as markdown or fitted to the terminal (docs/guarantees.md, "Shown"): labels wrap between
words (a long name between its dotted parts), values never wrap, nothing is cut or split."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any

from rich.table import Table as RichTable
from rich.text import Text

# What a column adds beside its text: padding 1 + 1 and the border before the next one; the
# table has no outer border and no padding at its edges, which gives back 3 of those.
FRAME, EDGES = 3, -3
NARROWEST = 8  # a wrapping column is never narrowed below this
ALIGNS = {"l": "left", "r": "right", "k": "left, kept on one line"}


@dataclass(frozen=True)
class Cell:
    text: str
    data: Any = None  # the JSON value(s) the text shows; None for labels


@dataclass
class Table:
    caption: str
    columns: list[str]
    rows: list[list[Cell]]
    key: str = ""  # stable identifier in a card's --format json
    align: str = ""  # ALIGNS per column; default: the first left, the rest (numbers) right

    def __post_init__(self) -> None:
        if not self.align:
            self.align = "l" + "r" * (len(self.columns) - 1)
        if len(self.align) != len(self.columns) or set(self.align) - set(ALIGNS):
            raise ValueError(
                f"table {self.key}: align {self.align!r} for {len(self.columns)} columns"
            )
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(
                    f"table {self.key}: row of {len(row)} cells, {len(self.columns)} columns"
                )

    @classmethod
    def of(
        cls, caption: str, columns: Sequence[str], rows: Sequence[Sequence[str]], align: str = ""
    ) -> Table:
        """A table of texts only (no JSON values behind them)."""
        return cls(caption, list(columns), [[Cell(t) for t in row] for row in rows], align=align)

    def texts(self) -> list[list[str]]:
        return [[cell.text for cell in row] for row in self.rows]

    def layout(self) -> list[Column]:
        return [Column(c, right=a == "r", wraps=False if a == "k" else None)
                for c, a in zip(self.columns, self.align)]  # fmt: skip

    def markdown(self) -> str:
        lines = [
            f"**{self.caption}**",
            "",
            "| " + " | ".join(_md_cell(c) for c in self.columns) + " |",
            "|" + "|".join("---:" if a == "r" else "---" for a in self.align) + "|",
        ]
        lines += ["| " + " | ".join(_md_cell(c.text) for c in row) + " |" for row in self.rows]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "caption": self.caption,
            "columns": self.columns,
            "rows": [
                {col: (cell.data if cell.data is not None else cell.text)
                 for col, cell in zip(self.columns, row)}
                for row in self.rows
            ],
        }  # fmt: skip

    def fitted(self, width: int, grouped: int = 0, titled: bool = True) -> RichTable:
        title = self.caption if titled else None
        return fitted_table(self.layout(), self.texts(), width, title=title, grouped=grouped)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


@dataclass(frozen=True)
class Column:
    header: str
    right: bool = False  # right-aligned: a number, which never wraps
    wraps: bool | None = None  # None: left-aligned columns wrap, right-aligned ones do not

    @property
    def wrapping(self) -> bool:
        return not self.right if self.wraps is None else self.wraps


# A name's parts, each with the separator that ends it: "layers.*.mlp" -> "layers.", "*.", "mlp"
# (an underscore joins the words of one identifier: q_a_proj is never broken)
_PARTS = re.compile(r"[^./-]*[./-]|[^./-]+")


def _parts(text: str) -> list[str]:
    return [p for word in _words(text) for p in _PARTS.findall(word)] or [""]


# A short bracketed group, kept on one line: "[95% CI]"
_BRACKETED = re.compile(r"\[[^\]\s]{1,6} [^\]]{1,6}\]")
_NBSP = "\u00a0"


def _words(text: str) -> list[str]:
    kept = _BRACKETED.sub(lambda m: m[0].replace(" ", _NBSP), text)
    return [w for w in re.split(r"[ \t\r\n]+", kept) if w] or [""]  # not str.split: NBSP stays


def wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width``: broken between words, a longer word between its
    dotted (or ``/ -``) parts, a longer part anywhere."""
    lines: list[str] = []
    for paragraph in text.splitlines() or [""]:
        joined = " ".join(_words(paragraph)) if paragraph.strip() else ""
        for line in textwrap.wrap(
            joined, width, break_long_words=False, break_on_hyphens=False
        ) or [""]:
            line = line.replace(_NBSP, " ")
            if len(line) <= width:
                lines.append(line)
                continue
            pieces = [""]
            for part in _PARTS.findall(line):
                if pieces[-1] and len(pieces[-1]) + len(part) > width:
                    pieces.append("")
                pieces[-1] += part
            lines += [p[i : i + width] for p in pieces for i in range(0, len(p) or 1, width)]
    return lines


def column_widths(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int
) -> list[int]:
    """Each column's text width, the widest narrowed first until the table fits ``width``:
    headers at words, then wrapping columns at words, at a name's parts, anywhere (NARROWEST)."""
    cells = [[row[i] for row in rows] for i in range(len(columns))]

    def longest(texts: Sequence[str], unit) -> int:
        return max((len(u) for text in texts for u in unit(text)), default=0)

    lines = [longest(col, str.splitlines) for col in cells]
    widths = [max(n, len(c.header)) for c, n in zip(columns, lines)]
    budget = width - FRAME * len(columns) - EDGES
    _narrow(widths, [max(n, longest([c.header], _words)) for c, n in zip(columns, lines)], budget)
    for unit in (_words, _parts):
        floors = [
            max(longest(col, unit), longest([c.header], _words)) if c.wrapping else w
            for c, col, w in zip(columns, cells, widths)
        ]
        _narrow(widths, floors, budget)
    # Last, a name is broken inside a part rather than a value squeezed (rich would fold it).
    _narrow(
        widths, [min(w, NARROWEST) if c.wrapping else w for c, w in zip(columns, widths)], budget
    )
    return widths


def _narrow(widths: list[int], floors: list[int], budget: int) -> None:
    while sum(widths) > budget:
        above = [i for i, (w, f) in enumerate(zip(widths, floors)) if w > f]
        if not above:
            return
        widths[max(above, key=lambda i: widths[i])] -= 1


def fitted_table(
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    width: int,
    *,
    title: str | None = None,
    grouped: int = 0,
) -> RichTable:
    """A rich table of ``rows`` that fits ``width`` where its values and names can (rich folds a
    cell rather than cut it); the first ``grouped`` columns show a label once per run of rows
    with it, its lines spread down the run, a line between groups.  A table too wide turns into
    one row per row and value column: the labels, ``measure`` and ``value``."""
    widths = column_widths(columns, rows, width)
    k = next((i for i, c in enumerate(columns) if c.right), len(columns))
    if 0 < k <= len(columns) - 2 and not _whole(columns, rows, widths, width):
        melted = [*columns[:k], Column("measure"), Column("value", right=True)]
        cells = [[*r[:k], c.header, r[j]] for r in rows for j, c in enumerate(columns) if j >= k]
        if _whole(melted, cells, column_widths(melted, cells, width), width):
            columns, rows, grouped = melted, cells, k
            widths = column_widths(columns, rows, width)
    lines = [[wrap(text, w) for text, w in zip(row, widths)] for row in rows]
    for col in reversed(range(grouped)):
        for _, run in groupby(range(len(rows)), key=lambda i: list(rows[i][: col + 1])):
            run_rows = list(run)
            label = wrap(rows[run_rows[0]][col], widths[col])
            for i in run_rows:  # the run's last row takes the rest
                height = max((len(cell) for cell in lines[i][col + 1 :]), default=1)
                take, label = (label, []) if i == run_rows[-1] else (label[:height], label[height:])
                lines[i][col] = take or [""]
    shown = None if title is None else Text(title)
    if title is not None and len(title) > sum(widths) + 3 * (len(widths) - 1):
        # too wide to centre over the table: broken at words to ``width``, left-aligned
        shown = Text("\n".join(wrap(title, width)), no_wrap=True, overflow="ignore", justify="left")
    out = RichTable(title=shown, show_edge=False, pad_edge=False)
    for column, w in zip(columns, widths):
        out.add_column(
            Text("\n".join(wrap(column.header, w))),
            justify="right" if column.right else "left",
            width=w,
            overflow="fold",
        )
    for r, row_lines in enumerate(lines):
        last_of_group = grouped > 0 and (r + 1 == len(rows) or rows[r + 1][0] != rows[r][0])
        out.add_row(*(Text("\n".join(cell)) for cell in row_lines), end_section=last_of_group)
    return out


def _whole(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], widths: list[int], width: int
) -> bool:
    """At ``widths`` the table fits ``width``, no word split (a name only between its parts)."""
    for i, (c, w) in enumerate(zip(columns, widths)):
        unit = _parts if c.wrapping else str.splitlines  # a header wraps at its words
        cells = [len(u) for row in rows for u in unit(row[i])] + [len(u) for u in _words(c.header)]
        if w < max(cells):
            return False
    return sum(widths) + FRAME * len(widths) + EDGES <= width
