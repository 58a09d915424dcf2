"""Running the CLI in tests: a command that must succeed, and one that must fail with the
project's one-line error (docs/guarantees.md); and a script of evals/ or examples/ loaded as a
module."""

import importlib.util
from pathlib import Path
from types import ModuleType

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


def load_script(path: Path) -> ModuleType:
    """The Python script at ``path`` (not a package module) imported as a module of its stem."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
