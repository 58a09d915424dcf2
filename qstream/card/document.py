"""The card as data, rendered as markdown, HTML or JSON, and written safely (docs/guarantees.md,
"Atomic" and "Refused"): built in ``.<card name>.qstream-partial-<pid>/``, published by renames,
figures first; a card file without :data:`MARKER` needs ``--overwrite``."""

from __future__ import annotations

import html
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qstream.errors import QStreamError
from qstream.publish import (
    check_parent,
    json_text,
    listing,
    partial_dir,
    remove_stale_partials,
    stderr_notice,
)
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


MARKDOWN: dict[type, Callable] = {
    Table: Table.markdown,
    Figure: lambda part: f"![{part.alt}]({part.path})\n\n*{part.caption}*",
    Code: lambda part: f"```\n{part.text}\n```",
    Bullets: lambda part: "\n".join(f"- {item}" for item in part.items),
    str: lambda part: part,
}


# HTML written directly (no markdown library): the card's structure is known.
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


def render(card: Card, fmt: str) -> str:
    """The card's text in ``fmt`` (md, json or html) with the generated-card marker."""
    if fmt == "html":
        out = [
            "<!DOCTYPE html>",
            marker_comment(),
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{html.escape(card.title)}</title><style>{_STYLE}</style></head><body>",
            f"<h1>{html.escape(card.title)}</h1>",
            *_sections(card, lambda title: f"<h2>{html.escape(title)}</h2>", HTML),
            "</body></html>",
        ]
        return "\n".join(out) + "\n"
    if fmt != "json":
        out = [f"# {card.title}", *_sections(card, lambda title: f"## {title}", MARKDOWN)]
        return f"{marker_comment()}\n" + "\n\n".join(out) + "\n"
    sections = [
        {"title": s.title,
         "text": [p for p in s.parts if isinstance(p, str)],
         "items": [i for p in s.parts if isinstance(p, Bullets) for i in p.items],
         "tables": [p.to_json() for p in s.parts if isinstance(p, Table)],
         "figures": [{"path": p.path, "caption": p.caption} for p in s.parts if isinstance(p, Figure)],
         "code": [p.text for p in s.parts if isinstance(p, Code)]}
        for s in card.sections
    ]  # fmt: skip
    return json_text(
        {"generated_by": MARKER, "schema": CARD_SCHEMA, "title": card.title,
         "missing": card.missing, "sections": sections}
    )  # fmt: skip


MARKER = "generated by qstream card"
# The figures a card may draw (qstream/card/figures.py): a directory holding only these is ours.
FIGURE_NAMES = frozenset(
    {"ceiling.png", "seq_agree.png", "kl.png", "context.png", "calibration.png"}
)
_SNIFF_BYTES = 4096  # the marker is in the first line (md, json) or the second (html)


def marker_comment() -> str:
    return f"<!-- {MARKER}: regenerate it rather than edit it -->"


def figures_dir(output: Path) -> Path:
    return output.parent / f"{output.stem}_files"


def _what_is_there(path: Path) -> str:
    if path.is_dir():
        return "a directory holding " + (listing(path) or "nothing")
    size = path.stat().st_size if path.exists() else 0
    return f"a file of {size} bytes without the '{MARKER}' marker"


def check_card_target(output: Path, overwrite: bool, figures: bool) -> None:
    """Refuse, before any work, what the card may not replace (module docstring)."""
    if output.is_dir():
        raise QStreamError(f"--output {output} is a directory; give the card's file name")
    check_parent(output, "--output")
    if output.exists() and not overwrite:
        try:  # a card qstream wrote carries the marker
            with open(output, "rb") as handle:
                ours = MARKER in handle.read(_SNIFF_BYTES).decode("utf-8", errors="replace")
        except OSError:
            ours = False
        if not ours:
            raise QStreamError(
                f"--output {output} already exists and is not a card qstream wrote "
                f"({_what_is_there(output)}); use --overwrite to replace it"
            )
    fig = figures_dir(output)
    if not figures or not (fig.exists() or fig.is_symlink()):
        return
    if (
        fig.is_symlink()
        or not fig.is_dir()
        or not all(p.is_file() and p.name in FIGURE_NAMES for p in fig.iterdir())
    ):
        raise QStreamError(
            f"--output {output}: {fig} is in the way of the card's figures "
            f"({_what_is_there(fig)}); move it or use --no-figures"
        )


def publish_card(output: Path, text: str, draw: Callable[[Path], list[Path]] | None) -> list[Path]:
    """Write the card text and ``draw(directory)``'s figures atomically (figures first, the old
    directory kept aside until the card is in place and put back on failure); the paths."""
    remove_stale_partials(output, stderr_notice)
    tmp = partial_dir(output, "--output")
    fig, old, new = figures_dir(output), tmp / "old-figures", tmp / "figures"
    try:
        drawn = _build(tmp, text, draw, output)
        try:
            if drawn:
                if fig.exists():
                    fig.rename(old)
                new.rename(fig)
            os.replace(tmp / "card", output)
        except OSError as exc:
            if drawn and not new.exists() and fig.is_dir():
                fig.rename(new)  # ours: removed with tmp
            if old.exists():
                old.rename(fig)
            raise QStreamError(f"cannot write --output {output}: {exc.strerror or exc}") from exc
        return [output, *(fig / p.name for p in drawn)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build(tmp: Path, text: str, draw, output: Path) -> list[Path]:
    try:
        (tmp / "card").write_text(text, encoding="utf-8")
        return [] if draw is None else draw(tmp / "figures")
    except OSError as exc:
        raise QStreamError(f"cannot write --output {output}: {exc.strerror or exc}") from exc
