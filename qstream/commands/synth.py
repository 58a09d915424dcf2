"""``qstream synth``: write a synthetic DSpark draft checkpoint (docs/model.md)."""

from __future__ import annotations

import click

from qstream.arch.registry import ARCHITECTURES
from qstream.cli import DIRECTORY, Command, json_option, option, write_json
from qstream.progress import counter


@click.command(cls=Command)
@option(
    "preset",
    "The DSpark-MLA draft: tiny (tests), small (CPU benchmarks, H 1024, V 32k) or k3 "
    "(Kimi-K3 shapes, 7.1 GB); the Qwen3-style DSpark draft: qwen3-tiny (tests) or qwen3-8b "
    "(Qwen3-8B shapes, 2.3 GB); the DFlash draft: qwen3-dflash-tiny (its backbone, no "
    "heads); the EAGLE-3 draft: eagle3-tiny (Llama form).  [default: tiny, or qwen3-tiny "
    "for a Qwen3 --target]",
    type=click.Choice([p for arch in ARCHITECTURES for p in arch.presets]),
    default=None,
)
@option("output_dir", "Where to write.", required=True, type=DIRECTORY)
@option("seed", "Same seed, same bytes.")
@option(
    "corpus",
    "GSM8K JSONL or text to train the tokenizer and Markov statistics on "
    "(default: a built-in generated corpus of arithmetic word problems).",
    type=click.Path(dir_okay=False, exists=True),
)
@option(
    "target",
    "A Hugging Face target to shape the draft for (its hidden size, depth, vocabulary, "
    "tokenizer and embed_tokens; lm_head is borrowed with --target at load time); a Qwen3 "
    "target gets a Qwen3-style draft with its attention shapes and RoPE, and no embed_tokens.",
)
@option("overwrite", "Replace an existing output directory.")
@option(
    "device",
    "Checked like eval-drift's; the weights are drawn on the CPU whatever it says, so that "
    "the same seed writes the same bytes on every machine.",
)
@json_option()
def synth(preset, output_dir, seed, corpus, target, overwrite, device, json_path) -> None:
    """Write a synthetic DSpark draft checkpoint: config.json, bf16 safetensors, a BPE
    tokenizer and a stand-in target head (target_head/); with --target, a draft shaped for
    that Hugging Face target, with its tokenizer.

    \b
    qstream synth --preset tiny --output_dir tiny --corpus gsm8k/train.jsonl
    qstream synth --preset qwen3-tiny --output_dir qwen3-tiny
    qstream synth --target TARGET --output_dir draft --corpus gsm8k/train.jsonl
    """
    # here, not above: --help loads no torch
    from qstream.device import resolve_device
    from qstream.synth.draft import synth_checkpoint
    from qstream.synth.target import synth_for_target

    resolve_device(device)
    with counter(f"synth {preset or ('tiny' if target is None else 'draft')}", "bytes") as bar:
        if target is None:
            summary = synth_checkpoint(preset or "tiny", output_dir, seed, corpus, overwrite, bar)
        else:
            summary = synth_for_target(target, output_dir, preset, seed, corpus, overwrite, bar)
    if json_path != "-":
        top1 = summary.predicted_top1  # None: no Markov head
        what = "tokenizer" if top1 is None else "tokenizer and Markov statistics"
        tail = "" if top1 is None else f"; calibrated mean top-1 {top1:.2f}"
        click.echo(
            f"wrote {summary.output_dir}: {summary.preset}, {summary.tensors} tensors, "
            f"{summary.parameters:,} parameters, {summary.bytes / 2**30:.2f} GiB bf16 "
            f"({what} from {summary.corpus}{tail})"
        )
    write_json(vars(summary), json_path)
