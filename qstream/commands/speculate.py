"""``qstream speculate``: the click layer over :func:`qstream.speculate.run.run_speculate`
(docs/speculate.md, "Command")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from qstream.clichoices import CAPTURE_DTYPES, EVAL_FORMATS, SPECULATE_RULES, VARIANT_FORMATS
from qstream.clitypes import CommaChoice
from qstream.cliutil import (
    Command,
    count_option,
    device_option,
    flag_option,
    json_option,
    list_option,
    make_console,
    option,
    sampling_option,
    seed_option,
    variant_option,
    write_json,
)
from qstream.progress import counter
from qstream.publish import signals_as_interrupt

if TYPE_CHECKING:
    from qstream.speculate.run import SpeculateSettings


@click.command(cls=Command)
@option(
    "target",
    required=True,
    type=click.Path(file_okay=False),
    help="Hugging Face target directory (local): verifies every block, and lends the draft "
    "its embed_tokens and lm_head when the draft has none.",
)
@option(
    "model",
    required=True,
    type=click.Path(file_okay=False),
    help="Draft checkpoint directory (unquantized: the source of the simulated formats).",
)
@option(
    "corpus",
    type=click.Path(dir_okay=False),
    help="GSM8K-style JSONL or plain text; each document's first line is a prompt. "
    "Default: the built-in GSM8K test split.",
)
@count_option("prompts", 32, "Prompts: the corpus's first documents.")
@count_option("new_tokens", 128, "Tokens emitted per prompt.", minimum=2)
@option(
    "formats",
    type=CommaChoice(EVAL_FORMATS),
    default=",".join(VARIANT_FORMATS),
    show_default=True,
    help="Comma-separated simulated variants, as eval-drift builds them.",
)
@variant_option()
@flag_option("allow_foreign_variant", "Decode with a --variant not derived from --model anyway.")
@flag_option(
    "no_integrity_check",
    "Use a --variant without checking its files against the sha256s its "
    "qstream_quantize.json records; the results say it was not checked.",
)
@list_option(
    "include_layers",
    help="Modules the simulated formats quantize (default: the draft architecture's shipped list).",
)
@list_option("ignore_layers", help="Modules never quantized.")
@option(
    "rule",
    type=click.Choice(SPECULATE_RULES),
    default=SPECULATE_RULES[0],
    show_default=True,
    help="Verification rule (docs/speculate.md): greedy, a greedy draft against a sampling "
    "verifier, a sampled draft under the token-wise rejection sampler, or under block "
    "verification.",
)
@sampling_option("temperature", "Temperature of the drafter and the verifier (greedy ignores it).")
@seed_option("Prompt i decodes with seed + i, for every variant.")
@option(
    "dtype",
    type=click.Choice(CAPTURE_DTYPES),
    help="The target's weights and compute (the variants compute in bf16, fp32 in fp32). "
    "Default: float32 on a CPU, bfloat16 on CUDA.",
)
@device_option("Where the target runs (the draft drafts on the CPU).")
@option(
    "capture",
    type=click.Path(file_okay=False),
    metavar="DIR",
    help="With --rule greedy: also write the decoded streams' target states (qstream's capture "
    "layout) and, per variant, anchors-NAME.json, the blocks its decoder drafted, for "
    "eval-drift --states DIR --states-anchors DIR/anchors-NAME.json (docs/speculate.md).",
)
@json_option()
def speculate(json_path: str | None, **o: Any) -> None:
    """Decode with the target in the loop, once per draft variant, and measure acceptance:
    mean acceptance length, tokens per target forward, and the share of verifications that
    accept at least k drafted tokens, with 95% intervals over prompts.

    \b
    qstream speculate --target TARGET --model DRAFT
    qstream speculate --target TARGET --model DRAFT --formats bf16,nvfp4 \\
        --variant shipped=DRAFT_NVFP4 --prompts 64 --new-tokens 128 --json spec.json
    qstream speculate --target TARGET --model DRAFT --rule probabilistic --temperature 0.7
    """
    # here, not above: `qstream speculate --help` loads no torch
    from qstream.card.measured import speculate_tables
    from qstream.speculate.run import run_speculate

    with signals_as_interrupt(), counter("speculate", "prompts") as progress:
        results = run_speculate(_settings(o), progress)
    if json_path != "-":
        console = make_console()
        for table in speculate_tables(results):
            console.print(table.fitted(console.width))
    write_json(results, json_path)


def _settings(o: dict[str, Any]) -> SpeculateSettings:
    """The parsed options as the library's settings; most options are its fields by name."""
    from dataclasses import fields

    from qstream.eval.run import parse_variants
    from qstream.speculate.run import SpeculateSettings

    parsed = {
        "formats": tuple(f.strip() for f in o["formats"].split(",") if f.strip()),
        "variant_dirs": parse_variants(o["variant"]),
        "include": tuple(o["include_layers"]),
        "ignore": tuple(o["ignore_layers"]),
        "integrity_check": not o["no_integrity_check"],
    }
    same = {f.name: o[f.name] for f in fields(SpeculateSettings) if f.name in o}
    return SpeculateSettings(**{**same, **parsed})
