import json

from click.testing import CliRunner

from qstream.cli import cli
from qstream.formats import FORMATS


def test_formats_json_lists_every_format_with_its_snr():
    result = CliRunner().invoke(cli, ["formats", "--json", "-"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    by_name = {r["format"]: r for r in data["formats"]}
    assert set(by_name) == set(FORMATS)
    assert by_name["mxfp4"]["bits_per_weight"] == 4.25
    assert by_name["nvfp4"]["bits_per_weight"] == 4.5
    assert by_name["nvfp4"]["vllm_layout"] == "nvfp4-pack-quantized"
    # 8-bit beats both 4-bit formats on a Gaussian; NVFP4's finer blocks beat MXFP4's.
    snr = {k: v["weight_snr_db"] for k, v in by_name.items()}
    assert snr["fp8"] > snr["nvfp4"] > snr["mxfp4"] > 15.0


def test_formats_json_to_a_file_and_same_seed_same_numbers(tmp_path):
    out = tmp_path / "f.json"
    runner = CliRunner()
    assert runner.invoke(cli, ["formats", "--json", str(out)]).exit_code == 0
    again = runner.invoke(cli, ["formats", "--json", "-"])
    assert json.loads(out.read_text()) == json.loads(again.output)


def test_both_option_spellings_and_greedy_lists():
    import click

    from qstream.cli import Command, list_option, option

    @click.command(cls=Command)
    @option("model_dir")
    @list_option("include_layers")
    def probe(model_dir, include_layers):
        click.echo(f"{model_dir}|{','.join(include_layers)}")

    runner = CliRunner()
    for flag in ("--model-dir", "--model_dir"):
        out = runner.invoke(
            probe, [flag, "D", "--include_layers", "a", "b", "--include-layers", "c"]
        )
        assert out.exit_code == 0, out.output
        assert out.output.strip() == "D|a,b,c"


def test_user_errors_are_one_line_and_exit_1(tmp_path):
    result = CliRunner().invoke(cli, ["formats", "--json", str(tmp_path / "no" / "dir.json")])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: --json ") and "does not exist" in result.stderr
    assert result.stderr.count("\n") == 1
