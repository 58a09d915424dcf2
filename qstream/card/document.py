"""The card as data (sections of paragraphs, tables, figures and code) and its three renderings:
GitHub-flavoured markdown, a standalone HTML page, and JSON.  Its tables are
:class:`qstream.tablefit.Table`, each cell keeping the number it shows."""

from __future__ import annotations

import html
import re
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


# ---------------------------------------------------------------------------------------------
# Markdown


def render_markdown(card: Card) -> str:
    out = [f"# {card.title}"]
    for section in card.sections:
        out.append(f"## {section.title}")
        for part in section.parts:
            if isinstance(part, Table):
                out.append(part.markdown())
            elif isinstance(part, Figure):
                out.append(f"![{part.alt}]({part.path})\n\n*{part.caption}*")
            elif isinstance(part, Code):
                out.append(f"```\n{part.text}\n```")
            elif isinstance(part, Bullets):
                out.append("\n".join(f"- {item}" for item in part.items))
            else:
                out.append(part)
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


def render_html(card: Card) -> str:
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(card.title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(card.title)}</h1>",
    ]
    for section in card.sections:
        out.append(f"<h2>{html.escape(section.title)}</h2>")
        for part in section.parts:
            if isinstance(part, Table):
                out.append(_html_table(part))
            elif isinstance(part, Figure):
                out.append(
                    f'<figure><img src="{html.escape(part.path)}" '
                    f'alt="{html.escape(part.alt)}"><figcaption>'
                    f"{_inline(part.caption)}</figcaption></figure>"
                )
            elif isinstance(part, Code):
                out.append(f"<pre><code>{html.escape(part.text)}</code></pre>")
            elif isinstance(part, Bullets):
                out.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in part.items) + "</ul>")
            else:
                out.append(f"<p>{_inline(part)}</p>")
    out.append("</body></html>")
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
