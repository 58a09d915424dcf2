"""``qstream capture``: the click layer over :func:`qstream.capture.run.run_capture`
(docs/capture.md)."""

from __future__ import annotations

from typing import Any

import click

from qstream.cli import (
    CAPTURE_EXPORTS,
    COUNT,
    DIRECTORY,
    LAYER_CONVENTIONS,
    Command,
    json_option,
    list_option,
    option,
    write_json,
)
from qstream.progress import counter
from qstream.publish import signals_as_interrupt
from qstream.serving import TARGETS


@click.command(cls=Command)
@option("target", "Hugging Face target directory (local).", required=True)
@option("model", "Draft directory: its target_layer_ids, widths and block size.", required=True)
@option("output", "Directory to write (or resume).", type=DIRECTORY, required=True)
@option("corpus", "GSM8K-style JSONL or plain text. Default: the built-in GSM8K test split.")
@list_option(
    "layers", help="Layer ids to capture instead of the draft's target_layer_ids.", type=int
)
@option(
    "layer_convention",
    "The convention --layers is written in (docs/capture.md).",
    type=click.Choice(LAYER_CONVENTIONS),
    default=LAYER_CONVENTIONS[0],
)
@option(
    "dtype",
    "The target's weights, compute and the states written. Default: float32 on a CPU, "
    "bfloat16 on CUDA (and with --device-map).",
)
@option("device", "Where the target runs (one device; see --device-map).")
@option(
    "device_map",
    "Spread the target over the available devices (accelerate).",
    type=click.Choice(["auto"]),
)
@option(
    "max_tokens", "Corpus tokens per stream (the prompt, with --generate).", type=COUNT, default=512
)
@option("streams", "How many streams. Default: every document long enough.", type=COUNT)
@option("batch_size", "Streams per forward, grouped by length.", type=COUNT, default=8)
@option(
    "generate",
    "Continue each prompt with the target's own samples (exact acceptance).",
    is_flag=True,
)
@option(
    "apply_chat_template",
    "With --generate: each document's first line as one user turn through the target's chat "
    "template, with the generation prompt, as the prompt.",
    is_flag=True,
)
@option("new_tokens", "With --generate: tokens sampled per stream.", type=COUNT, default=256)
@option("temperature", "With --generate: the evaluation's temperature.")
@option("top_p", "With --generate: the evaluation's (verifier's) top-p.")
@option("top_k", "With --generate: the evaluation's top-k.")
@option("seed", "With --generate: same seed, same streams.")
@option(
    "export",
    "qstream's layout or vLLM's / speculators' (hs_{i}.safetensors).",
    type=click.Choice(CAPTURE_EXPORTS),
    default=CAPTURE_EXPORTS[0],
)
@option("trust_remote_code", "Allow the checkpoint's own model code to run.", is_flag=True)
@option(
    "target_format",
    "Serve the target's decoder Linear weights quantized-dequantized in this weight format "
    '(docs/capture.md, "A quantized target"); lm_head and embeddings stay as stored.',
    type=click.Choice(TARGETS),
    default=TARGETS[0],
)
@json_option()
def capture(json_path: str | None, **o: Any) -> None:
    """Capture a Hugging Face target's hidden states for eval-drift --states: one file per
    stream plus capture.json; an interrupted run resumes where it stopped.

    \b
    qstream capture --target TARGET --model DRAFT --output states/ --streams 64
    qstream capture --target TARGET --model DRAFT --output nvfp4/ --target-format nvfp4
    qstream capture --target TARGET --model DRAFT --output gen/ --generate \\
        --max-tokens 32 --new-tokens 256 --temperature 1.0 --top-p 0.95
    qstream eval-drift --model DRAFT --target TARGET --states states/ --acceptance
    """
    # here, not above: `qstream capture --help` loads no torch
    from dataclasses import fields

    from qstream.capture.run import CaptureSettings, Sampling, run_capture
    from qstream.device import resolve_device

    resolve_device(o["device"])  # a bad or absent device is one line before anything loads
    sampling = None
    if o["generate"]:
        sampling = Sampling(o["new_tokens"], o["temperature"], o["top_p"], o["top_k"], o["seed"])
    same = {f.name: o[f.name] for f in fields(CaptureSettings) if f.name in o}
    layers = tuple(o["layers"]) or None
    settings = CaptureSettings(**{**same, "layers": layers, "sampling": sampling})
    with signals_as_interrupt(), counter("capture", "streams") as progress:
        summary = run_capture(settings, progress)
    if json_path != "-":
        click.echo(
            f"wrote {summary.written} streams ({summary.tokens:,} tokens) to {summary.output}; "
            f"{summary.skipped} already there, {summary.streams} in all"
        )
    write_json(vars(summary), json_path)
