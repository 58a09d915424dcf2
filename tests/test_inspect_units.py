"""qstream inspect on small and quantized checkpoints: sizes in a unit that shows them (never
"0.000 GiB"), and weight statistics of the (dequantized) weights, never of the scale tensors."""

import json

import pytest
from click.testing import CliRunner

from qstream.cli import cli
from qstream.units import human_size

QUANTIZED = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize(
    "n_bytes, shown",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (450 * 1024 + 676, "450.66 KiB"),
        ((1 << 20) - 1, "1024.00 KiB"),
        (3 << 20, "3.00 MiB"),
        (5 << 30, "5.00 GiB"),
    ],
)
def test_human_size_picks_the_largest_unit_reached(n_bytes, shown):
    assert human_size(n_bytes) == shown


def _inspect(directory, *extra):
    result = CliRunner().invoke(cli, ["inspect", str(directory), *extra])
    assert result.exit_code == 0, result.output
    return result.output


def test_a_small_checkpoint_is_not_shown_as_zero_gib(tiny):
    out = _inspect(tiny, "--no-stats")
    title = " ".join(out[: out.index("module kind")].split())  # the title may wrap
    assert "0.000 GiB" not in title and "KiB" in title, title


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_quantized_statistics_describe_the_weights(tiny, tmp_path, fmt):
    out = tmp_path / fmt
    result = CliRunner().invoke(
        cli,
        [
            "quantize",
            "--model_dir",
            tiny,
            "--output_dir",
            str(out),
            "--quant_format",
            fmt,
            "--include_layers",
            *QUANTIZED,
        ],
    )
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(_inspect(out, "--json", "-"))["weight_stats"]}
    base = {r["name"]: r for r in json.loads(_inspect(tiny, "--json", "-"))["weight_stats"]}
    assert not [n for n in rows if n.rpartition(".")[2].startswith("weight_")], sorted(rows)
    assert set(rows) == set(base)  # one row per weight, quantized or not
    gate = "layers.0.mlp.gate_proj.weight"
    assert rows[gate]["dequantized"] is True and "dequantized" not in base[gate]
    # 4-bit weights keep their std within a few percent (FP4 error ~ 10% of each value, random)
    assert rows[gate]["std"] == pytest.approx(base[gate]["std"], rel=0.1)
