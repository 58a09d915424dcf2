"""qstream's one kind of table, :class:`Table`: a caption, headers and cells keeping the text
shown and the JSON value behind it, rendered as the card's markdown or fitted to the terminal
(docs/guarantees.md, "Shown"): label columns wrap between words (a long name between its dotted
parts), values never wrap, no cell is cut short, no table is split.  *Grouped* leading columns
show a label once per run of rows with it, its lines spread down the run.

>>> table = Table.of("sizes", ["module kind", "size"], [["embed_tokens.weight", "121.88 KiB"]])
>>> console.print(table.fitted(100))
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
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
    """Each cell keeps its text and, for a measured number, that number as the results JSON
    holds it (``data``): the card's ``--format json`` and the tests read it."""

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
        """How :func:`column_widths` sees the columns."""
        return [Column(c, right=a == "r", wraps=False if a == "k" else None)
                for c, a in zip(self.columns, self.align)]  # fmt: skip

    def markdown(self) -> str:
        """GitHub-flavoured markdown, the caption in bold above."""
        lines = [
            f"**{self.caption}**",
            "",
            "| " + " | ".join(_md_cell(c) for c in self.columns) + " |",
            "|" + "|".join("---:" if a == "r" else "---" for a in self.align) + "|",
        ]
        lines += ["| " + " | ".join(_md_cell(c.text) for c in row) + " |" for row in self.rows]
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The table as data: each cell its JSON value, a label its text."""
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
        """:func:`fitted_table` of this table, the caption its title if ``titled``."""
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
    """``text``'s words, a short bracketed group counting as one."""
    kept = _BRACKETED.sub(lambda m: m[0].replace(" ", _NBSP), text)
    return [w for w in re.split(r"[ \t\r\n]+", kept) if w] or [""]  # not str.split: NBSP stays


def wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters: broken between words; a word longer
    than the width between its dotted (or ``/ -``) parts; a part longer still, anywhere."""
    lines: list[str] = []
    for paragraph in text.splitlines() or [""]:
        joined = " ".join(_words(paragraph)) if paragraph.strip() else ""
        for line in textwrap.wrap(
            joined, width, break_long_words=False, break_on_hyphens=False
        ) or [""]:
            line = line.replace(_NBSP, " ")
            lines += _break_name(line, width) if len(line) > width else [line]
    return lines


def _break_name(word: str, width: int) -> list[str]:
    lines, line = [], ""
    for part in _PARTS.findall(word):
        if line and len(line) + len(part) > width:
            lines.append(line)
            line = ""
        line += part
    lines.append(line)
    return [piece[i : i + width] for piece in lines for i in range(0, len(piece) or 1, width)]


def column_widths(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int
) -> list[int]:
    """Each column's text width, its longest line narrowed, widest first, until the table fits
    ``width``: headers wrap at words, then wrapping columns at words, at a name's parts, anywhere
    (down to NARROWEST)."""
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
    """Take one column from the widest column above its floor until the widths fit ``budget``."""
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
    cell rather than cut it); the first ``grouped`` columns grouped, a line between groups."""
    widths = column_widths(columns, rows, width)
    melted = None if _whole(columns, rows, widths, width) else _melt(columns, rows)
    if melted is not None and _whole(*melted, column_widths(*melted, width), width):
        (columns, rows), grouped = melted, len(melted[0]) - 2
        widths = column_widths(columns, rows, width)
    lines = [[wrap(text, w) for text, w in zip(row, widths)] for row in rows]
    for col in reversed(range(grouped)):
        _spread(lines, col, widths[col], rows)
    out = RichTable(title=_title(title, widths, width), show_edge=False, pad_edge=False)
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


def _title(title: str | None, widths: list[int], width: int) -> Text | None:
    """The caption above a table of columns ``widths``: centred over it where it fits, else
    broken at words to ``width`` and left-aligned, never squeezed into the table's width."""
    if title is None or len(title) <= sum(widths) + 3 * (len(widths) - 1):
        return None if title is None else Text(title)
    return Text("\n".join(wrap(title, width)), no_wrap=True, overflow="ignore", justify="left")


def _whole(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], widths: list[int], width: int
) -> bool:
    """At ``widths`` the table fits ``width`` with no word split (a name only between its parts)
    and no value wrapped."""
    for i, (c, w) in enumerate(zip(columns, widths)):
        unit = _parts if c.wrapping else str.splitlines  # a header wraps at its words
        cells = [len(u) for row in rows for u in unit(row[i])] + [len(u) for u in _words(c.header)]
        if w < max(cells):
            return False
    return sum(widths) + FRAME * len(widths) + EDGES <= width


def _melt(
    columns: Sequence[Column], rows: Sequence[Sequence[str]]
) -> tuple[list[Column], list[list[str]]] | None:
    """One row per row and value column: the labels, a ``measure`` column naming the value's
    column and a ``value`` column (None without labels and two values)."""
    k = next((i for i, c in enumerate(columns) if c.right), len(columns))
    if k == 0 or len(columns) - k < 2:
        return None
    melted = [*columns[:k], Column("measure"), Column("value", right=True)]
    return melted, [
        [*row[:k], c.header, row[j]] for row in rows for j, c in enumerate(columns) if j >= k
    ]


def _spread(
    lines: list[list[list[str]]], col: int, width: int, rows: Sequence[Sequence[str]]
) -> None:
    """Column ``col`` of a run of rows with the same leading labels shows its label once, its
    lines spread down the run; the run's last row takes the rest."""
    r = 0
    while r < len(rows):
        end = r + 1
        while end < len(rows) and list(rows[end][: col + 1]) == list(rows[r][: col + 1]):
            end += 1
        label = wrap(rows[r][col], width)
        for i in range(r, end):
            height = max((len(cell) for cell in lines[i][col + 1 :]), default=1)
            take, label = (label, []) if i == end - 1 else (label[:height], label[height:])
            lines[i][col] = take or [""]
        r = end
