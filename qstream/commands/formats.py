"""``qstream formats``: the three formats side by side, with their weight SNR on a seeded
Gaussian test tensor."""

from __future__ import annotations

import click

from qstream.cli import Command, json_option, make_console, option, write_json
from qstream.progress import step
from qstream.tablefit import Table

# The table's columns; names (format, layout) wrap only when the width leaves no choice.
FORMAT_COLUMNS = ("format", "bits/weight", "block", "scale", "vLLM layout", "weight SNR (dB)")


@click.command(cls=Command)
@option("seed", "Seed of the Gaussian test tensor.")
@json_option()
def formats(seed: int, json_path: str | None) -> None:
    """Show the weight formats qstream writes and their weight SNR.

    Bits per weight include the scales (FP8's per-channel scale is amortised over the
    4096-wide test row).  Example: qstream formats --json -
    """
    records: list[dict] = []
    with step("quantizing the test tensor to each format"):
        # here, not above: `qstream formats --help` loads no torch
        import torch

        from qstream.formats import FORMATS, dequantize, quantize, weight_snr_db

        gen = torch.Generator().manual_seed(seed)
        w = (torch.randn(256, 4096, generator=gen) * 0.02).to(torch.bfloat16)
        for spec in FORMATS.values():
            w_hat = dequantize(spec.name, quantize(spec.name, w))
            records.append(
                {
                    "format": spec.name,
                    "bits_per_weight": spec.bits_per_weight if spec.block_size else 8 + 16 / 4096,
                    "block_size": spec.block_size or "per channel",
                    "scale_type": spec.scale_type,
                    "vllm_layout": spec.layout,
                    "weight_snr_db": round(weight_snr_db(w, w_hat), 3),
                }
            )
    data = {"test_tensor": "bf16 [256, 4096] ~ N(0, 0.02^2)", "seed": seed, "formats": records}
    if json_path != "-":
        rows = [
            [
                r["format"],
                f"{r['bits_per_weight']:.3f}",
                str(r["block_size"]),
                r["scale_type"],
                r["vllm_layout"],
                f"{r['weight_snr_db']:.2f}",
            ]
            for r in records
        ]
        title = f"qstream weight formats (SNR on a bf16 [256, 4096] Gaussian, seed {seed})"
        console = make_console()
        console.print(Table.of(title, FORMAT_COLUMNS, rows, align="lrlllr").fitted(console.width))
    write_json(data, json_path)
