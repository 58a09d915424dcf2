"""``qstream speculate``: the click layer over :func:`qstream.speculate.run.run_speculate`
(docs/speculate.md, "Command")."""

from __future__ import annotations

from typing import Any

import click

from qstream.cli import (
    COUNT,
    DIRECTORY,
    Command,
    ModeChoice,
    json_option,
    make_console,
    option,
    write_json,
)
from qstream.progress import counter
from qstream.publish import signals_as_interrupt
from qstream.verification import GREEDY, SPECULATE_MODES


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
@option("prompts", "Prompts: the corpus's first documents.", type=COUNT, default=32)
@option(
    "apply_chat_template",
    "Each prompt as one user turn through the target's chat template, with the generation "
    "prompt (as a chat-tuned draft was trained).",
    is_flag=True,
)
@option("new_tokens", "Tokens emitted per prompt.", type=click.IntRange(min=2), default=128)
@option("formats", "Comma-separated simulated variants, as eval-drift builds them.")
@option("kv_cache_dtype")
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
@option(
    "rule",
    'Verification mode, DRAFT/VERIFIER as vLLM names them (docs/acceptance.md, "Modes"): '
    "vLLM's draft_sample_method, then its rejection_sample_method, or greedy: a verifier at "
    "temperature 0.",
    type=ModeChoice(SPECULATE_MODES),
    default=SPECULATE_MODES[0],
)
@option("temperature", "Temperature of the drafter and the verifier (a greedy one ignores it).")
@option("seed", "Prompt i decodes with seed + i, for every variant.")
@option(
    "dtype",
    "The target's weights and compute (the variants compute in bf16, fp32 in fp32). "
    "Default: float32 on a CPU, bfloat16 on CUDA.",
)
@option("device", "Where the target runs (the draft drafts on the CPU).")
@option(
    "capture",
    f"With --rule {GREEDY.name}: also write the decoded streams' target states (qstream's "
    "capture layout) and, per variant, anchors-NAME.json, the blocks its decoder drafted, for "
    "eval-drift --states DIR --states-anchors DIR/anchors-NAME.json (docs/speculate.md).",
    type=DIRECTORY,
    metavar="DIR",
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
    qstream speculate --target TARGET --model DRAFT --rule probabilistic/block --temperature 0.7
    qstream speculate --target CHAT_TARGET --model DRAFT --apply-chat-template
    """
    # here, not above: `qstream speculate --help` loads no torch
    from qstream.card.measured import speculate_tables
    from qstream.speculate.run import SpeculateSettings, run_speculate

    settings = SpeculateSettings(**o)
    with signals_as_interrupt(), counter("speculate", "prompts") as report:
        results = run_speculate(settings, report)
    if json_path != "-":
        console = make_console()
        for table in speculate_tables(results):
            console.print(table.fitted(console.width))
    write_json(results, json_path)
