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
from qstream.tablefit import Column, fitted_table

if TYPE_CHECKING:
    from rich.table import Table

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
    from qstream.speculate.run import run_speculate

    with signals_as_interrupt(), counter("speculate", "prompts") as progress:
        results = run_speculate(_settings(o), progress)
    if json_path != "-":
        console = make_console()
        for table in acceptance_tables(results, console.width):
            console.print(table)
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


MEAN_COLUMNS = (
    Column("variant"),
    Column("mean acceptance length", right=True),
    Column("tokens / target forward", right=True),
    Column("loss vs bf16", right=True),
)


def _with_interval(estimate: dict, spec: str = ".2f") -> str:
    value, lo, hi = (estimate[k] for k in ("value", "lo", "hi"))
    if lo is None or hi is None:
        return f"{value:{spec}}"
    return f"{value:{spec}} [{lo:{spec}}, {hi:{spec}}]"


def acceptance_tables(results: dict, width: int) -> list[Table]:
    """Per variant its mean acceptance length, tokens per target forward and loss against bf16
    (paired over the prompts; n/a without a bf16 variant) with their 95% intervals; then per k (a row each, so that any block size fits) every variant's share of
    verifications accepting at least k drafted tokens."""
    summaries = {name: entry["summary"] for name, entry in results["variants"].items()}
    s, prompts = results["settings"], next(iter(summaries.values()))["prompts"]
    means = [
        [
            name,
            _with_interval(x["mean_acceptance_length"]),
            _with_interval(x["tokens_per_target_forward"]),
            _with_interval(x["loss_vs_bf16"], "+.3f") if "loss_vs_bf16" in x else "n/a",
        ]
        for name, x in summaries.items()
    ]
    title = f"{s['rule']} verification, {prompts} prompts x {s['new_tokens']} new tokens"
    block = results["provenance"]["draft"]["block_size"]
    shares = [
        [str(k), *(f"{x['accepted_at_least'][k - 1]['value']:.3f}" for x in summaries.values())]
        for k in range(1, block + 1)
    ]
    return [
        fitted_table(MEAN_COLUMNS, means, width, title=title + " (95% intervals over prompts)"),
        fitted_table(
            [Column("k", right=True), *(Column(name, right=True) for name in summaries)],
            shares,
            width,
            title="share of verifications accepting at least k drafted tokens",
        ),
    ]
