"""``qstream card``: the click layer over :func:`qstream.card.build.write_card`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from qstream.cli import CARD_FORMATS, FILE, Command, option
from qstream.progress import step
from qstream.publish import signals_as_interrupt
from qstream.regimes import AUX_REGIMES, DEFAULT_REGIME


@click.command("card", cls=Command)
@click.argument("results", nargs=-1, required=True, type=FILE)
@option(
    "checkpoint",
    "A quantized checkpoint the card describes; repeatable (one per format).",
    multiple=True,
    metavar="DIR",
)
@option(
    "no_integrity_check",
    "Describe a --checkpoint without checking its files against the sha256s its "
    "qstream_quantize.json records; the card says it was not checked.",
)
@option("base", "The unquantized checkpoint the others were made from.", metavar="DIR")
@option(
    "speculate",
    "qstream speculate --json results of the same draft: the card shows the acceptance "
    "measured with the target in the loop beside what eval-drift predicted.",
    metavar="FILE",
    type=FILE,
)
@option(
    "output",
    "Card file; figures go to <PATH stem>_files/ beside it.",
    required=True,
    metavar="PATH",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(CARD_FORMATS),
    default=CARD_FORMATS[0],
    show_default=True,
    help="Card format: markdown, JSON (the tables as data) or a standalone HTML page.",
)
@option(
    "regime",
    f"Regime of the full metric table (default: {DEFAULT_REGIME.name}, the pessimistic one).",
    type=click.Choice(AUX_REGIMES),
)
@option("no_figures", "Tables only: draw and reference no figures.", is_flag=True)
@option(
    "overwrite",
    "Replace an existing --output file that is not a card qstream wrote (a card it "
    "wrote is replaced without asking).",
)
def card(results: tuple[str, ...], output: str, no_figures: bool, **o: Any) -> None:
    """Write model-card tables and figures from eval-drift results.

    RESULTS are eval-drift --json files (one per regime, or one with several); they are merged,
    and results of different models or conflicting duplicates are refused.  What the results
    lack is listed in the card and on stderr.

    \b
    qstream card results/*.json --checkpoint draft-fp8 --base draft --output CARD.md
    qstream card all.json --output card.html --format html --regime boot

    An existing --output that qstream did not write is refused unless --overwrite; the card and
    its figures appear complete or not at all; a --checkpoint whose files differ from the
    sha256s its qstream_quantize.json records is refused (docs/guarantees.md).
    """
    # here, not above: --help loads no torch
    from qstream.card.build import write_card

    what = f"writing {output}" + ("" if no_figures else " and its figures")
    with signals_as_interrupt(), step(what):
        card_doc, written = write_card(
            results,
            Path(output),
            checkpoints=o["checkpoint"],
            base=o["base"],
            regime=o["regime"],
            fmt=o["fmt"],
            figures=not no_figures,
            overwrite=o["overwrite"],
            integrity_check=not o["no_integrity_check"],
            speculate=o["speculate"],
        )
    for line in card_doc.missing:
        click.echo(f"missing: {line}", err=True)
    figures = f" and {len(written) - 1} figures in {written[1].parent}" if len(written) > 1 else ""
    click.echo(f"wrote {written[0]}{figures}")
