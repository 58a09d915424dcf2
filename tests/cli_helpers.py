"""Running the CLI in tests: a command that must succeed, and one that must fail with the
project's one-line error (docs/guarantees.md)."""

from click.testing import CliRunner

from qstream.cli import cli


def cli_ok(args: list[str]):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return result


def cli_error(args: list[str]) -> str:
    """The command exits 1 with exactly one ``Error: …`` line on stderr and no traceback."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output, result.output
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr
