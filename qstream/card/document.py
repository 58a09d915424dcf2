"""The card as data (sections of paragraphs, tables, figures and code) and its three renderings:
GitHub-flavoured markdown, a standalone HTML page, and JSON.  Its tables are
:class:`qstream.tablefit.Table`, each cell keeping the number it shows."""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from qstream.tablefit import Table

CARD_SCHEMA = "qstream.card/1"


@dataclass(frozen=True)
class Figure:
    path: str  # relative to the card file
    alt: str
    caption: str


@dataclass(frozen=True)
class Code:
    text: str


@dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]


Part = str | Table | Figure | Code | Bullets  # a str is a paragraph (inline `code` allowed)


@dataclass
class Section:
    title: str
    parts: list[Part] = field(default_factory=list)


@dataclass
class Card:
    title: str
    sections: list[Section]
    missing: list[str]  # what the results set lacks, one sentence each


def _sections(card: Card, heading: Callable[[str], str], render: dict[type, Callable]) -> list[str]:
    """Each section's heading, then each of its parts rendered by its type's ``render``."""
    out = []
    for section in card.sections:
        out += [heading(section.title), *(render[type(part)](part) for part in section.parts)]
    return out


# ---------------------------------------------------------------------------------------------
# Markdown

MARKDOWN: dict[type, Callable] = {
    Table: Table.markdown,
    Figure: lambda part: f"![{part.alt}]({part.path})\n\n*{part.caption}*",
    Code: lambda part: f"```\n{part.text}\n```",
    Bullets: lambda part: "\n".join(f"- {item}" for item in part.items),
    str: lambda part: part,
}


def render_markdown(card: Card) -> str:
    out = [f"# {card.title}", *_sections(card, lambda title: f"## {title}", MARKDOWN)]
    return "\n\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# HTML (no markdown library: the card's structure is known, so it is written directly)

_STYLE = """body{font-family:system-ui,sans-serif;max-width:72rem;margin:2rem auto;padding:0 1rem;
line-height:1.45;color:#1b1b1b;background:#fff}table{border-collapse:collapse;margin:.5rem 0 1.5rem}
th,td{border:1px solid #c8c8c8;padding:.25rem .5rem}td.r{text-align:right}td.l{text-align:left}
th{background:#f0f0f0}code,pre{background:#f4f4f4;font-family:ui-monospace,monospace}
pre{padding:.75rem;overflow-x:auto;white-space:pre-wrap}img{max-width:100%}
figcaption{font-style:italic;margin-bottom:1.5rem}caption{font-weight:bold;text-align:left}"""


def _inline(text: str) -> str:
    """Escape, then turn `code` spans and **bold** into tags (the only markup paragraphs use)."""
    escaped = html.escape(text)
    escaped = re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", escaped)


def _html_table(table: Table) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in table.columns)
    body = "\n".join(
        "<tr>"
        + "".join(f'<td class="{a}">{html.escape(c.text)}</td>' for a, c in zip(table.align, row))
        + "</tr>"
        for row in table.rows
    )
    return (
        f"<table><caption>{_inline(table.caption)}</caption>\n<thead><tr>{head}</tr></thead>"
        f"\n<tbody>\n{body}\n</tbody></table>"
    )


HTML: dict[type, Callable] = {
    Table: _html_table,
    Figure: lambda part: (
        f'<figure><img src="{html.escape(part.path)}" alt="{html.escape(part.alt)}">'
        f"<figcaption>{_inline(part.caption)}</figcaption></figure>"
    ),
    Code: lambda part: f"<pre><code>{html.escape(part.text)}</code></pre>",
    Bullets: lambda part: "<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in part.items) + "</ul>",
    str: lambda part: f"<p>{_inline(part)}</p>",
}


def render_html(card: Card) -> str:
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(card.title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(card.title)}</h1>",
        *_sections(card, lambda title: f"<h2>{html.escape(title)}</h2>", HTML),
        "</body></html>",
    ]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# JSON


def card_json(card: Card) -> dict:
    sections = []
    for section in card.sections:
        sections.append(
            {
                "title": section.title,
                "text": [p for p in section.parts if isinstance(p, str)],
                "items": [i for p in section.parts if isinstance(p, Bullets) for i in p.items],
                "tables": [p.to_json() for p in section.parts if isinstance(p, Table)],
                "figures": [
                    {"path": p.path, "caption": p.caption}
                    for p in section.parts
                    if isinstance(p, Figure)
                ],
                "code": [p.text for p in section.parts if isinstance(p, Code)],
            }
        )
    return {
        "schema": CARD_SCHEMA,
        "title": card.title,
        "missing": card.missing,
        "sections": sections,
    }
