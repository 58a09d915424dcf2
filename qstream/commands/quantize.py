"""``qstream quantize`` / ``qstream-quantize``: the click layer over
:func:`qstream.quant.quantize_checkpoint`."""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from qstream.cli import (
    CALIBRATION_BLOCKS,
    COUNT,
    WEIGHT_FORMATS,
    Choice,
    Command,
    json_option,
    list_option,
    make_console,
    option,
    write_json,
)
from qstream.progress import counter
from qstream.regimes import AUX_REGIMES
from qstream.serving import ACTIVATIONS, KV_CACHES

if TYPE_CHECKING:
    from qstream.quant import QuantizeSummary


@click.command(cls=Command)
@option("model_dir", "Input checkpoint directory.", required=True, metavar="DIR")
@option("output_dir", "Output directory (must not exist).", required=True, metavar="DIR")
@option(
    "quant_format",
    "Weight format.",
    required=True,
    type=Choice(WEIGHT_FORMATS),
    metavar="{fp8,mxfp4,nvfp4}",
)
@list_option(
    "include_layers",
    help="Modules to quantize (default: every 2-D Linear weight except embeddings, "
    "lm_head and MoE routers).",
    metavar="PAT...",
)
@list_option("ignore_layers", help="Modules never to quantize (wins).", metavar="PAT...")
@option(
    "device",
    "Where tensors are quantized; the bytes written are the same on either.",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    metavar="{cpu,cuda}",
)
@option("workers", "Pieces quantized in parallel (default: the CPUs available).", type=COUNT)
@option("dry_run", "Print the plan and sizes; write nothing.", is_flag=True)
@option("overwrite", "Replace an existing output directory.", is_flag=True)
@option(
    "skip_incompatible",
    "Leave weights whose K is not a multiple of the block size unquantized.",
    is_flag=True,
)
@option(
    "tensor_parallel_size",
    "The tensor-parallel size vLLM will serve a K3 DSpark draft at "
    "(draft_tensor_parallel_size). vLLM 0.32.0 builds the same modules quantized at "
    "every N; an N it cannot build the draft at (heads, split sizes) is refused, and in "
    "FP4 the shape rule applies to each o_proj/down_proj shard. No effect on other "
    "architectures.",
    type=COUNT,
    default=1,
    metavar="N",
)
@option(
    "activations",
    "How vLLM quantizes the quantized linears' inputs (input_activations): fp8-dynamic "
    "with --quant_format fp8 (W8A8, per token); fp8-static (fp8) and nvfp4 (nvfp4: W4A4) store "
    "calibrated input scales and need --calibration.",
    type=Choice(list(ACTIVATIONS)),
    default="none",
    metavar="{" + ",".join(ACTIVATIONS) + "}",
)
@option(
    "kv_cache_scheme",
    "Declare an FP8 KV cache with per-layer k_scale/v_scale (kv_cache_scheme); the "
    "scales need --calibration.",
    type=Choice([k.name for k in KV_CACHES.values() if k.dtype == "float8_e4m3fn"]),
    metavar="fp8",
)
@option(
    "calibration",
    "Where static scales are measured: the FP32 reference drafts blocks of this aux "
    "regime over the built-in GSM8K corpus (as eval-drift's calibration at --seed), or the "
    "first rows of captured states (a file or directory, as eval-drift --states reads).",
    metavar="{" + ",".join(AUX_REGIMES) + "}|STATES",
)
@option(
    "calibration_blocks",
    "Blocks of the regime (captured states: rows, one block each) --calibration runs.",
    type=COUNT,
    default=CALIBRATION_BLOCKS,
)
@option("seed", "Seed of a --calibration regime's blocks and aux states.")
@option(
    "target",
    "Target checkpoint the calibration's draft borrows lm_head (and embed_tokens) from. "
    "Default: the draft's target_head directory.",
)
@option("no_snr", "Skip the weight SNR (a little faster).", is_flag=True)
@json_option()
def quantize(json_path: str | None, **o: Any) -> None:
    """Write an FP8 / MXFP4 / NVFP4 checkpoint in the compressed-tensors layout.

    Patterns match a module name (a tensor name without .weight) when equal, as a dotted
    suffix, as a glob, or with re: as a Python regex.  For a DSpark draft (config.json
    architectures K3DSparkModel) vLLM's loading rules apply (docs/vllm.md).  Example:

    \b
    qstream-quantize --model_dir draft --output_dir draft-fp8 --quant_format fp8 \\
      --include_layers mlp.gate_proj mlp.up_proj mlp.down_proj self_attn.o_proj
    qstream-quantize --model_dir draft --output_dir draft-w4a4 --quant_format nvfp4 \\
      --activations nvfp4 --calibration heavy
    """
    # here, not above: --help loads no torch
    from qstream.calibration import CalibrationSet
    from qstream.quant import quantize_checkpoint

    calibration = None
    if o["calibration"] is not None:  # run by quantize once the options are checked
        named = CalibrationSet(o["calibration"], o["calibration_blocks"], o["seed"], o["target"])
        calibration = partial(named.run, o["model_dir"])

    with counter("quantizing", "bytes") as progress:  # bytes on the bar, tensors in its name
        summary = quantize_checkpoint(
            o["model_dir"],
            o["output_dir"],
            o["quant_format"],
            include=list(o["include_layers"]) or None,
            ignore=list(o["ignore_layers"]) or None,
            device=o["device"],
            workers=o["workers"],
            dry_run=o["dry_run"],
            overwrite=o["overwrite"],
            skip_incompatible=o["skip_incompatible"],
            progress=progress,
            snr=not o["no_snr"],
            tensor_parallel_size=o["tensor_parallel_size"],
            activations=o["activations"],
            kv_cache_scheme=o["kv_cache_scheme"],
            calibration=calibration,
        )
    for warning in summary.warnings:
        click.echo(f"Warning: {warning}", err=True)
    if json_path != "-":
        console = make_console()
        if o["dry_run"]:
            console.print(plan_table(summary))
        console.print(summary_table(summary))
    write_json(summary.to_json(), json_path)


def plan_table(summary: QuantizeSummary) -> Table:
    """The dry run's plan: quantized modules by kind, and any skipped ones."""
    from rich.markup import escape  # a cell is rich markup: "[skipped]" would be a style tag

    from qstream.checkpoint.inspect import module_kind

    table = Table(title=escape(f"plan: {summary.quant_format} for {summary.model_dir}"))
    table.add_column("quantized module kind")
    table.add_column("count", justify="right")
    for kind, count in Counter(module_kind(m) for m in summary.modules_quantized).items():
        table.add_row(escape(kind), str(count))
    for module, reason in summary.modules_skipped.items():
        table.add_row(escape(f"[skipped] {module}: {reason}"), "")
    return table


def summary_table(summary: QuantizeSummary) -> Table:
    from qstream.units import human_size

    s = summary.to_json()
    table = Table(
        title="qstream quantize"
        + (" (dry run: nothing written)" if summary.dry_run else f": {summary.output_dir}")
    )
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("format", summary.quant_format)
    for key, value in summary.serving.items():
        if isinstance(value, dict):  # the calibration's source: what it was, and its size
            size = ("regime", "captured", "blocks", "tokens")
            value = ", ".join(f"{k} {v}" for k, v in value.items() if k in size)
        table.add_row(key.replace("_", " "), str(value))
    table.add_row(
        "parameters quantized",
        f"{summary.params_quantized:,} / "
        f"{summary.params_total:,} ({s['params_quantized_pct']:.1f}%)",
    )
    table.add_row(
        "modules quantized / ignored",
        f"{len(summary.modules_quantized)} / {len(summary.modules_ignored)}",
    )
    table.add_row(
        "vLLM serving rules",
        f"{summary.serving_profile}, tensor_parallel_size "
        f"{summary.tensor_parallel_size}, {len(summary.ignore)} ignore entries",
    )
    if summary.modules_skipped:
        table.add_row("skipped (incompatible shape)", str(len(summary.modules_skipped)))
    table.add_row(
        "size",
        f"{human_size(summary.bytes_before)} -> "
        f"{human_size(summary.bytes_after)} ({s['size_ratio_pct']:.1f}%)",
    )
    if summary.weight_snr_db:
        worst = s["worst_snr_db"]
        table.add_row("weight SNR mean", f"{s['mean_snr_db']:.2f} dB")
        table.add_row("weight SNR worst", f"{worst['db']:.2f} dB ({worst['module']})")
    if not summary.dry_run:
        table.add_row("time", f"{summary.seconds:.1f} s ({summary.workers} workers)")
    return table
