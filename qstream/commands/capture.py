"""``qstream capture``: the click layer over :func:`qstream.capture.run.run_capture`
(docs/capture.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from qstream.clichoices import CAPTURE_DTYPES, CAPTURE_EXPORTS, LAYER_CONVENTIONS
from qstream.cliutil import (
    Command,
    count_option,
    device_option,
    flag_option,
    json_option,
    list_option,
    option,
    sampling_option,
    seed_option,
    write_json,
)
from qstream.progress import counter
from qstream.publish import signals_as_interrupt

if TYPE_CHECKING:
    from qstream.capture.run import CaptureSettings


@click.command(cls=Command)
@option(
    "target",
    required=True,
    type=click.Path(file_okay=False),
    help="Hugging Face target directory (local).",
)
@option(
    "model",
    required=True,
    type=click.Path(file_okay=False),
    help="Draft directory: its target_layer_ids, widths and block size.",
)
@option(
    "output",
    required=True,
    type=click.Path(file_okay=False),
    help="Directory to write (or resume).",
)
@option(
    "corpus",
    type=click.Path(dir_okay=False),
    help="GSM8K-style JSONL or plain text. Default: the built-in GSM8K test split.",
)
@list_option(
    "layers", type=int, help="Layer ids to capture instead of the draft's target_layer_ids."
)
@option(
    "layer_convention",
    type=click.Choice(LAYER_CONVENTIONS),
    default="layer-output",
    show_default=True,
    help="The convention --layers is written in (docs/capture.md).",
)
@option(
    "dtype",
    type=click.Choice(CAPTURE_DTYPES),
    help="The target's weights, compute and the states written. Default: float32 on a CPU, "
    "bfloat16 on CUDA (and with --device-map).",
)
@device_option("Where the target runs (one device; see --device-map).")
@option(
    "device_map",
    type=click.Choice(["auto"]),
    default=None,
    help="Spread the target over the available devices (accelerate).",
)
@count_option("max_tokens", 512, "Corpus tokens per stream (the prompt, with --generate).")
@count_option("streams", None, "How many streams. Default: every document long enough.")
@count_option("batch_size", 8, "Streams per forward, grouped by length.")
@flag_option("generate", "Continue each prompt with the target's own samples (exact acceptance).")
@count_option("new_tokens", 256, "With --generate: tokens sampled per stream.")
@sampling_option("temperature", "With --generate: the evaluation's temperature.")
@sampling_option("top_p", "With --generate: the evaluation's (verifier's) top-p.")
@sampling_option("top_k", "With --generate: the evaluation's top-k.")
@seed_option("With --generate: same seed, same streams.")
@option(
    "export",
    type=click.Choice(CAPTURE_EXPORTS),
    default="qstream",
    show_default=True,
    help="qstream's layout or vLLM's / speculators' (hs_{i}.safetensors).",
)
@flag_option("trust_remote_code", "Allow the checkpoint's own model code to run.")
@json_option()
def capture(json_path: str | None, **o: Any) -> None:
    """Capture a Hugging Face target's hidden states for eval-drift --states: one file per
    stream plus capture.json; an interrupted run resumes where it stopped.

    \b
    qstream capture --target TARGET --model DRAFT --output states/ --streams 64
    qstream capture --target TARGET --model DRAFT --output gen/ --generate \\
        --max-tokens 32 --new-tokens 256 --temperature 1.0 --top-p 0.95
    qstream eval-drift --model DRAFT --target TARGET --states states/ --acceptance
    """
    # here, not above: `qstream capture --help` loads no torch
    from qstream.capture.run import run_capture
    from qstream.device import resolve_device

    resolve_device(o["device"])  # a bad or absent device is one line before anything loads
    settings = _settings(o)
    with signals_as_interrupt(), counter("capture", "streams") as progress:
        summary = run_capture(settings, progress)
    if json_path != "-":
        click.echo(
            f"wrote {summary.written} streams ({summary.tokens:,} tokens) to {summary.output}; "
            f"{summary.skipped} already there, {summary.streams} in all"
        )
    write_json(vars(summary), json_path)


def _settings(o: dict[str, Any]) -> CaptureSettings:
    """The parsed options as the library's settings; most options are its fields by name."""
    from dataclasses import fields

    from qstream.capture.run import CaptureSettings
    from qstream.capture.streams import Sampling

    sampling = None
    if o["generate"]:
        sampling = Sampling(o["new_tokens"], o["temperature"], o["top_p"], o["top_k"], o["seed"])
    same = {f.name: o[f.name] for f in fields(CaptureSettings) if f.name in o}
    return CaptureSettings(**{**same, "layers": tuple(o["layers"]) or None, "sampling": sampling})
