"""``qstream eval-drift``: the click layer over :func:`qstream.eval.drift.evaluate_drift`, its
options the fields of :class:`~qstream.eval.settings.DriftSettings`; its tables are the card's
(:func:`qstream.card.terminal.print_report`)."""

from __future__ import annotations

from typing import Any

import click
from rich.console import Console

from qstream.arch.dspark_mla import QUANTIZE_INCLUDE
from qstream.cli import (
    COUNT,
    DEFAULT_EDGES,
    DIRECTORY,
    FILE,
    LAYER_CONVENTIONS,
    SENSITIVITY_FORMAT,
    STATES_AUTO,
    STATES_FORMATS,
    Command,
    FiniteRange,
    Integers,
    VariantTokens,
    json_option,
    make_console,
    option,
    write_json,
)
from qstream.progress import drift_progress
from qstream.regimes import ALL_REGIMES, AUX_REGIMES, DEFAULT_REGIME

WIDE_WIDTH = 1000  # --wide: room for any table at its natural width


@click.command("eval-drift", cls=Command)
@option("model", "Draft checkpoint directory. Default: the built-in synthetic tiny draft.")
@option("target", "Target checkpoint to borrow lm_head (and embed_tokens) from.")
@option("tokenizer", "tokenizer.json to use. Default: the draft's own.", type=FILE)
@option("corpus", "GSM8K-style JSONL (question, answer) or plain text. Default: built-in.")
@option("formats", "Comma-separated simulated variants.")
@option("kv_cache_dtype")
@option("variant")
@option(
    "allow_foreign_variant",
    "Compare a --variant that is not derived from --model anyway; it is labelled "
    "foreign in the JSON and the card.",
)
@option(
    "no_integrity_check",
    "Evaluate a --variant without checking its files against the sha256s its "
    "qstream_quantize.json records; the results say it was not checked.",
)
@option(
    "regime",
    f"Aux regime. Default: {DEFAULT_REGIME.name}, or none when --states is given.",
    type=click.Choice([*AUX_REGIMES, ALL_REGIMES]),
)
@option("blocks", "Blocks per regime.", type=COUNT, default=1024)
@option(
    "seed", "Seed of the block positions, aux states and sampling noise (same seed, same JSON)."
)
@option(
    "include_layers",
    "Modules the simulated formats quantize (default: the draft architecture's shipped "
    f"list; DSpark-MLA: {' '.join(QUANTIZE_INCLUDE)}).",
)
@option("ignore_layers")
@option("temperature", "The request's sampling temperature (drafter and verifier).")
@option(
    "top_p",
    "The verifier's (target's) top-p; the drafter samples the full distribution, as "
    "vLLM's DSpark drafter does.",
)
@option("top_k", "The verifier's (target's) top-k. Default: off.")
@option(
    "draft_top_p",
    "A top-p on the drafter, for engines that cut it (vLLM does not).",
    type=FiniteRange(0, 1, min_open=True),
    default=1.0,
)
@option(
    "acceptance",
    "Also verify each variant's drafts with the FP32 reference, in every mode vLLM "
    "serves: greedy draft (vLLM's default) and probabilistic draft under token-wise and block "
    "verification, a greedy verifier, and adaptive verification (docs/acceptance.md).",
    is_flag=True,
)
@option(
    "adaptive_requests",
    "Adaptive verification: blocks verified together as one batch's requests, whose "
    "drafts compete for the budget.",
    type=COUNT,
    default=8,
)
@option(
    "adaptive_budget",
    "Adaptive verification: share of a batch's drafted tokens verified (vLLM sizes it "
    "from its GPU's step costs).",
    type=FiniteRange(0, 1),
    default=0.5,
)
@option(
    "states",
    "Captured target states, a file or a directory: qstream's layout, vLLM / speculators "
    "safetensors or SpecForge .ckpt (docs/states.md). Adds the 'states' regime and the "
    "acceptance of every draft against the target itself.",
    type=click.Path(),
)
@option(
    "states_format",
    "Layout of --states; auto tells it from the files' contents.",
    type=click.Choice([STATES_AUTO, *STATES_FORMATS]),
    default=STATES_AUTO,
)
@option(
    "states_layer_convention",
    "How layer ids of --states are numbered: layer-output (id j = output of layer j, as "
    "the draft's target_layer_ids) or hidden-states-index (id k = output_hidden_states[k] = "
    "layer k-1's output, as vLLM's). Default: capture.json's, else the layout's own.",
    type=click.Choice(LAYER_CONVENTIONS),
)
@option(
    "states_layer_ids",
    "Comma-separated layer ids the states were captured at (e.g. vLLM's "
    "eagle_aux_hidden_state_layer_ids), checked against the draft's target_layer_ids.",
    type=Integers(),
    metavar="IDS",
    default=None,
)
@option(
    "states_anchors",
    "Evaluate the states regime at these blocks instead of --blocks uniformly drawn ones: "
    'a JSON file {"blocks": [[stream, anchor], ...]}, e.g. the anchors.json that qstream '
    "speculate --capture writes (the anchors its decoder visited).",
    type=FILE,
    metavar="FILE",
)
@option(
    "sensitivity",
    "Quantize one module kind at a time, then cumulatively (least harmful first), and "
    "suggest the largest --include_layers list within --tolerance (docs/sensitivity.md).",
    is_flag=True,
)
@option(
    "sensitivity_format",
    "Serving configuration --sensitivity probes: a format, or a token as --formats takes "
    "(nvfp4+a=nvfp4+kv=fp8_e4m3), its activation quantization on the probed modules only; "
    f"--kv-cache-dtype serves it too. Default: {SENSITIVITY_FORMAT}, or the first 4-bit format "
    "of --formats.",
    type=VariantTokens(one=True),
    metavar="TOKEN",
)
@option(
    "tolerance",
    "Greedy ceiling (tokens) the suggested include list may lose against bf16.",
    type=FiniteRange(0),
    default=0.1,
)
@option(
    "context_lengths",
    "Also sweep context length: comma-separated bucket edges in tokens; bare: "
    "0.25..32 x original_max_position_embeddings (docs/context-sweep.md).",
    type=Integers(increasing=True, keyword=DEFAULT_EDGES),
    is_flag=False,
    flag_value=DEFAULT_EDGES,
    default=None,
    metavar="EDGES",
)
@option("context_blocks", "Blocks per context-length bucket.", type=COUNT, default=256)
@option(
    "device",
    "Where the models compute. The FP32 reference stays FP32 on a GPU (TF32 off); "
    "metrics and verifiers run on the CPU.",
)
@option(
    "scratch_dir",
    "Where the reference's per-block outputs go when too big for memory (over 512 MiB: "
    "N x block x vocab x 4 bytes, twice with --acceptance); default: the system's temporary "
    "directory. Does not change results.",
    type=DIRECTORY,
    default=None,
    metavar="DIR",
)
@option(
    "wide",
    "Print each table at its natural width, however wide (default: tables fit the "
    "terminal, at most 100 columns: labels wrap, and a regime's metrics are one row per "
    "variant when the variants do not fit side by side).",
    is_flag=True,
)
@json_option()
def eval_drift(json_path: str | None, wide: bool, **options: Any) -> None:
    """Measure how far each format moves the drafted block from an FP32 reference.

    \b
    qstream eval-drift --regime heavy
    qstream eval-drift --regime heavy --acceptance --blocks 256
    qstream eval-drift --model DRAFT --states captured.safetensors --acceptance
    qstream eval-drift --model DRAFT --target TARGET --states hidden_states/ --blocks 512
    qstream eval-drift --regime heavy --formats bf16 --sensitivity --tolerance 0.1
    qstream eval-drift --regime heavy --formats bf16,nvfp4 --context-lengths
    qstream eval-drift --model DRAFT --target TARGET --corpus gsm8k/test.jsonl \\
        --formats bf16,fp8,mxfp4,nvfp4 --variant shipped=FP8_DIR --regime all \\
        --blocks 1024 --seed 0 --json results.json
    """
    # here, not above: `qstream eval-drift --help` loads no torch or scipy
    from qstream.card.terminal import print_report
    from qstream.eval.drift import evaluate_drift
    from qstream.eval.settings import DriftSettings

    console = make_console(stderr=json_path == "-")
    settings = DriftSettings(**options)
    with drift_progress() as progress:
        results = evaluate_drift(settings, say=console.print, progress=progress)
    if wide:
        console = Console(stderr=json_path == "-", width=WIDE_WIDTH)
    print_report(console, results, wide=wide)
    write_json(results, json_path)
