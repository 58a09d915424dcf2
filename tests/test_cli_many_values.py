"""Options that take several values, as published recipes write them (``--include_layers
mlp.gate_proj mlp.up_proj``, argparse's ``nargs="+"``): every value up to the next option, the
flag repeatable, in either spelling, on every command that has one (qstream/cli.py)."""

import click
import pytest
from click.testing import CliRunner

from qstream.cli import Command, list_option, option


@click.command(cls=Command)
@option("model_dir")
@list_option("include_layers")
@list_option("ignore_layers")
@list_option("layers", type=int)
@click.argument("rest", nargs=-1)
def probe(model_dir, include_layers, ignore_layers, layers, rest):
    click.echo(f"{model_dir}|{include_layers}|{ignore_layers}|{layers}|{rest}")


# the command line -> what the command gets: model_dir|include|ignore|layers|rest
CASES = {
    "values up to the next option": (
        ["--include_layers", "a", "b", "--model_dir", "D"],
        "D|('a', 'b')|()|()|()",
    ),
    "repeated, both spellings": (
        ["--include_layers", "a", "b", "--include-layers", "c"],
        "None|('a', 'b', 'c')|()|()|()",
    ),
    "two lists interleaved": (
        ["--include_layers", "a", "--ignore_layers", "x", "y", "--include_layers", "b"],
        "None|('a', 'b')|('x', 'y')|()|()",
    ),
    "first value after =": (["--include_layers=a", "b"], "None|('a', 'b')|()|()|()"),
    "first value may start with a dash": (["--layers", "-1", "2"], "None|()|()|(-1, 2)|()"),
    "-- ends the list": (["--include_layers", "a", "--", "b"], "None|('a',)|()|()|('b',)"),
    "a value that looks like an option": (
        ["--include_layers", "--ignore_layers", "x"],
        "None|('--ignore_layers', 'x')|()|()|()",
    ),
    "values after another option are its own": (
        ["--model_dir", "D", "a"],
        "D|()|()|()|('a',)",
    ),
    "a list's name as another option's value is that value": (
        ["--model_dir", "--include_layers", "a", "b"],
        "--include_layers|()|()|()|('a', 'b')",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_list_option_takes_every_value_up_to_the_next_option(case):
    args, expected = CASES[case]
    result = CliRunner().invoke(probe, args)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == expected


def test_a_list_option_without_a_value_is_a_usage_error():
    result = CliRunner().invoke(probe, ["--include_layers"])
    assert result.exit_code == 2
    assert "Option '--include_layers' requires an argument." in result.stderr


def test_a_list_value_of_the_wrong_type_names_the_option():
    result = CliRunner().invoke(probe, ["--layers", "1", "two"])
    assert result.exit_code == 2
    assert "Invalid value for '--layers'" in result.stderr


def test_the_commands_take_lists_as_the_readme_writes_them(tmp_path):
    from qstream.cli import cli

    result = CliRunner().invoke(
        cli,
        ["quantize", "--model_dir", str(tmp_path / "missing"), "--output_dir", "o",
         "--quant_format", "fp8", "--include_layers", "mlp.gate_proj", "mlp.up_proj",
         "--ignore_layers", "lm_head", "--dry-run"],
    )  # fmt: skip
    # parsed (the values are not taken for extra arguments): the library's one-line error
    assert result.exit_code == 1 and "not a directory" in result.stderr, result.output


@click.command(cls=Command)
@click.option("--edges", is_flag=False, flag_value="default")
@list_option("include_layers")
def optional_value(edges, include_layers):
    click.echo(f"{edges}|{include_layers}")


def test_an_option_whose_value_is_optional_leaves_a_list_to_itself():
    result = CliRunner().invoke(optional_value, ["--edges", "--include_layers", "a", "b"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "default|('a', 'b')"
