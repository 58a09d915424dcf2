"""``qstream speculate``: the click layer over :func:`qstream.speculate.run.run_speculate`
(docs/speculate.md, "Command")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from qstream.cli import (
    DIRECTORY,
    SPECULATE_RULES,
    Command,
    choice_option,
    count_option,
    json_option,
    make_console,
    option,
    write_json,
)
from qstream.progress import counter
from qstream.publish import signals_as_interrupt
from qstream.tablefit import Column, fitted_table

if TYPE_CHECKING:
    from rich.table import Table


@click.command(cls=Command)
@option(
    "target",
    "Hugging Face target directory (local): verifies every block, and lends the draft "
    "its embed_tokens and lm_head when the draft has none.",
    required=True,
)
@option(
    "model",
    "Draft checkpoint directory (unquantized: the source of the simulated formats).",
    required=True,
)
@option(
    "corpus",
    "GSM8K-style JSONL or plain text; each document's first line is a prompt. "
    "Default: the built-in GSM8K test split.",
)
@count_option("prompts", 32, "Prompts: the corpus's first documents.")
@count_option("new_tokens", 128, "Tokens emitted per prompt.", minimum=2)
@option("formats", "Comma-separated simulated variants, as eval-drift builds them.")
@option("variant")
@option("allow_foreign_variant", "Decode with a --variant not derived from --model anyway.")
@option(
    "no_integrity_check",
    "Use a --variant without checking its files against the sha256s its "
    "qstream_quantize.json records; the results say it was not checked.",
)
@option(
    "include_layers",
    "Modules the simulated formats quantize (default: the draft architecture's shipped list).",
)
@option("ignore_layers")
@choice_option(
    "rule",
    SPECULATE_RULES,
    SPECULATE_RULES[0],
    "Verification rule (docs/speculate.md): greedy, a greedy draft against a sampling "
    "verifier, a sampled draft under the token-wise rejection sampler, or under block "
    "verification.",
)
@option("temperature", "Temperature of the drafter and the verifier (greedy ignores it).")
@option("seed", "Prompt i decodes with seed + i, for every variant.")
@option(
    "dtype",
    "The target's weights and compute (the variants compute in bf16, fp32 in fp32). "
    "Default: float32 on a CPU, bfloat16 on CUDA.",
)
@option("device", "Where the target runs (the draft drafts on the CPU).")
@option(
    "capture",
    type=DIRECTORY,
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
    from qstream.speculate.run import SpeculateSettings, run_speculate

    settings = SpeculateSettings(**o)
    with signals_as_interrupt(), counter("speculate", "prompts") as report:
        results = run_speculate(settings, report)
    if json_path != "-":
        console = make_console()
        for table in acceptance_tables(results, console.width):
            console.print(table)
    write_json(results, json_path)


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
