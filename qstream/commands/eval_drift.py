"""``qstream eval-drift``: the click layer over :func:`qstream.eval.run.run_drift`; its tables
are the card's (:func:`qstream.card.terminal.print_report`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click
from rich.console import Console

from qstream.clichoices import (
    DEFAULT_EDGES,
    EVAL_FORMATS,
    LAYER_CONVENTIONS,
    QUANTIZE_INCLUDE,
    STATES_AUTO,
    STATES_FORMATS,
    VARIANT_FORMATS,
    WEIGHT_FORMATS,
)
from qstream.clitypes import CommaChoice, Integers
from qstream.cliutil import (
    Command,
    FiniteRange,
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
from qstream.progress import drift_progress
from qstream.regimes import ALL_REGIMES, AUX_REGIMES

if TYPE_CHECKING:
    from qstream.eval.settings import DriftSettings

WIDE_WIDTH = 1000  # --wide: room for any table at its natural width


@click.command("eval-drift", cls=Command)
@option(
    "model",
    type=click.Path(file_okay=False),
    help="Draft checkpoint directory. Default: the built-in synthetic tiny draft.",
)
@option(
    "target",
    type=click.Path(file_okay=False),
    help="Target checkpoint to borrow lm_head (and embed_tokens) from.",
)
@option(
    "tokenizer",
    type=click.Path(dir_okay=False),
    help="tokenizer.json to use. Default: the draft's own.",
)
@option(
    "corpus",
    type=click.Path(dir_okay=False),
    help="GSM8K-style JSONL (question, answer) or plain text. Default: built-in.",
)
@option(
    "formats",
    type=CommaChoice(EVAL_FORMATS),
    default=",".join(VARIANT_FORMATS),
    show_default=True,
    help="Comma-separated simulated variants.",
)
@variant_option()
@flag_option(
    "allow_foreign_variant",
    "Compare a --variant that is not derived from --model anyway; it is labelled "
    "foreign in the JSON and the card.",
)
@flag_option(
    "no_integrity_check",
    "Evaluate a --variant without checking its files against the sha256s its "
    "qstream_quantize.json records; the results say it was not checked.",
)
@option(
    "regime",
    type=click.Choice([*AUX_REGIMES, ALL_REGIMES]),
    default=None,
    help="Aux regime. Default: heavy, or none when --states is given.",
)
@count_option("blocks", 1024, "Blocks per regime.")
@seed_option("Seed of the block positions, aux states and sampling noise (same seed, same JSON).")
@list_option(
    "include_layers",
    help="Modules the simulated formats quantize (default: the draft architecture's shipped "
    f"list; DSpark-MLA: {' '.join(QUANTIZE_INCLUDE)}).",
)
@list_option("ignore_layers", help="Modules never quantized.")
@sampling_option("temperature", "The request's sampling temperature (drafter and verifier).")
@sampling_option(
    "top_p",
    "The verifier's (target's) top-p; the drafter samples the full distribution, as "
    "vLLM's DSpark drafter does.",
)
@sampling_option("top_k", "The verifier's (target's) top-k. Default: off.")
@option(
    "draft_top_p",
    type=FiniteRange(0, 1, min_open=True),
    default=1.0,
    show_default=True,
    help="A top-p on the drafter, for engines that cut it (vLLM does not).",
)
@flag_option(
    "acceptance",
    "Also verify each variant's drafts with the FP32 reference, in every mode vLLM "
    "serves: greedy draft (vLLM's default) and probabilistic draft under token-wise and block "
    "verification, a greedy verifier, and adaptive verification (docs/acceptance.md).",
)
@count_option(
    "adaptive_requests",
    8,
    "Adaptive verification: blocks verified together as one batch's requests, whose "
    "drafts compete for the budget.",
)
@option(
    "adaptive_budget",
    type=FiniteRange(0, 1),
    default=0.5,
    show_default=True,
    help="Adaptive verification: share of a batch's drafted tokens verified (vLLM sizes it "
    "from its GPU's step costs).",
)
@option(
    "states",
    type=click.Path(),
    help="Captured target states, a file or a directory: qstream's layout, vLLM / speculators "
    "safetensors or SpecForge .ckpt (docs/states.md). Adds the 'states' regime and the "
    "acceptance of every draft against the target itself.",
)
@option(
    "states_format",
    type=click.Choice([STATES_AUTO, *STATES_FORMATS]),
    default=STATES_AUTO,
    show_default=True,
    help="Layout of --states; auto tells it from the files' contents.",
)
@option(
    "states_layer_convention",
    type=click.Choice(LAYER_CONVENTIONS),
    default=None,
    help="How layer ids of --states are numbered: layer-output (id j = output of layer j, as "
    "the draft's target_layer_ids) or hidden-states-index (id k = output_hidden_states[k] = "
    "layer k-1's output, as vLLM's). Default: capture.json's, else the layout's own.",
)
@option(
    "states_layer_ids",
    type=Integers(),
    metavar="IDS",
    default=None,
    help="Comma-separated layer ids the states were captured at (e.g. vLLM's "
    "eagle_aux_hidden_state_layer_ids), checked against the draft's target_layer_ids.",
)
@option(
    "states_anchors",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Evaluate the states regime at these blocks instead of --blocks uniformly drawn ones: "
    'a JSON file {"blocks": [[stream, anchor], ...]}, e.g. the anchors.json that qstream '
    "speculate --capture writes (the anchors its decoder visited).",
)
@flag_option(
    "sensitivity",
    "Quantize one module kind at a time, then cumulatively (least harmful first), and "
    "suggest the largest --include_layers list within --tolerance (docs/sensitivity.md).",
)
@option(
    "sensitivity_format",
    type=click.Choice(WEIGHT_FORMATS),
    default=None,
    help="Format of --sensitivity. Default: nvfp4, or the first 4-bit format of --formats.",
)
@option(
    "tolerance",
    type=FiniteRange(0),
    default=0.1,
    show_default=True,
    help="Greedy ceiling (tokens) the suggested include list may lose against bf16.",
)
@option(
    "context_lengths",
    type=Integers(increasing=True, keyword=DEFAULT_EDGES),
    is_flag=False,
    flag_value=DEFAULT_EDGES,
    default=None,
    metavar="EDGES",
    help="Also sweep context length: comma-separated bucket edges in tokens; bare: "
    "0.25..32 x original_max_position_embeddings (docs/context-sweep.md).",
)
@count_option("context_blocks", 256, "Blocks per context-length bucket.")
@device_option(
    "Where the models compute. The FP32 reference stays FP32 on a GPU (TF32 off); "
    "metrics and verifiers run on the CPU."
)
@option(
    "scratch_dir",
    type=click.Path(file_okay=False),
    default=None,
    metavar="DIR",
    help="Where the reference's per-block outputs go when too big for memory (over 512 MiB: "
    "N x block x vocab x 4 bytes, twice with --acceptance); default: the system's temporary "
    "directory. Does not change results.",
)
@flag_option(
    "wide",
    "Print each table at its natural width, however wide (default: tables fit the "
    "terminal, at most 100 columns: labels wrap, and a regime's metrics are one row per "
    "variant when the variants do not fit side by side).",
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
    from qstream.eval.run import run_drift

    console = make_console(stderr=json_path == "-")
    settings = _settings(options)
    with drift_progress() as progress:
        where = {k: options[k] for k in ("model", "target", "tokenizer", "corpus")}
        results = run_drift(settings, **where, context_lengths=options["context_lengths"],
                            say=console.print, progress=progress)  # fmt: skip
    if wide:
        console = Console(stderr=json_path == "-", width=WIDE_WIDTH)
    print_report(console, results, wide=wide)
    write_json(results, json_path)


def _settings(o: dict[str, Any]) -> DriftSettings:
    """The parsed options as the library's settings."""
    from qstream.eval.run import parse_variants, resolve_regimes
    from qstream.eval.settings import (
        AdaptiveBudget,
        DriftSettings,
        Sampling,
        Scratch,
        Verification,
    )

    return DriftSettings(
        regimes=resolve_regimes(o["regime"], o["states"]),
        formats=tuple(f.strip() for f in o["formats"].split(",") if f.strip()),
        variant_dirs=parse_variants(o["variant"]),
        allow_foreign_variant=o["allow_foreign_variant"],
        integrity_check=not o["no_integrity_check"],
        include=tuple(o["include_layers"]),
        ignore=tuple(o["ignore_layers"]),
        n_blocks=o["blocks"],
        seed=o["seed"],
        sampling=Sampling(o["temperature"], o["top_p"], o["top_k"], o["draft_top_p"]),
        verification=Verification(
            o["acceptance"], AdaptiveBudget(o["adaptive_requests"], o["adaptive_budget"])
        ),
        states=o["states"],
        states_format=o["states_format"],
        states_layer_convention=o["states_layer_convention"],
        states_layer_ids=o["states_layer_ids"],
        states_anchors=o["states_anchors"],
        sensitivity=o["sensitivity"],
        sensitivity_format=o["sensitivity_format"],
        tolerance=o["tolerance"],
        context_blocks=o["context_blocks"],
        device=o["device"],
        scratch=Scratch(o["scratch_dir"]),
    )
