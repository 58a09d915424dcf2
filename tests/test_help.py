"""Every option of every command says what it does (docs/quantize.md: the help is the
reference a user reads first), and reading the help is instant: ``qstream --help`` and every
``qstream COMMAND --help`` load none of the heavy libraries the commands run on
(evals/bench_help.py measures the time)."""

import json
import subprocess
import sys

import click
import pytest

from qstream.cli import COMMANDS, cli

# What a help screen must not import: each costs from a tenth of a second to seconds of CPU.
HEAVY = ("torch", "scipy", "numpy", "safetensors", "transformers", "matplotlib")

# One help screen through a console script's own entry point, in a fresh interpreter: its exit
# status, whether it printed a usage line, and the heavy modules it loaded.
HELP_RUNNER = """
import contextlib, io, json, sys
from qstream import entry

sys.argv = [{script!r}, *{args!r}]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        getattr(entry, {script!r})()
        code = 0
    except SystemExit as exc:
        code = exc.code
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set({heavy!r}))
print(json.dumps([code, out.getvalue().startswith("Usage:"), loaded]))
"""

# (entry point, arguments): the group's help, qstream-quantize's, and every command's.
SCREENS = [("main", ["--help"]), ("quantize_main", ["--help"])]
SCREENS += [("main", [name, "--help"]) for name in COMMANDS]


def _commands(group: click.Group):
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        yield name, command
        if isinstance(command, click.Group):
            yield from _commands(command)


def test_every_option_has_help_text():
    commands = dict(_commands(cli))
    assert {"quantize", "inspect", "verify", "synth", "eval-drift", "card"} <= set(commands)
    missing = [
        f"{name} {param.opts[0]}"
        for name, command in commands.items()
        for param in command.params
        if isinstance(param, click.Option) and not (param.help or "").strip()
    ]
    assert missing == [], f"options without help: {', '.join(missing)}"


SCRIPT_NAMES = {"main": "qstream", "quantize_main": "qstream-quantize"}


@pytest.mark.parametrize(
    "script, args", SCREENS, ids=[" ".join([SCRIPT_NAMES[s], *a]) for s, a in SCREENS]
)
def test_help_screens_import_nothing_heavy(script, args):
    code = HELP_RUNNER.format(script=script, args=args, heavy=HEAVY)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    status, usage, loaded = json.loads(run.stdout)
    assert (status, usage) == (0, True), run.stdout
    assert loaded == [], f"{SCRIPT_NAMES[script]} {' '.join(args)} imports {', '.join(loaded)}"


def test_the_help_s_light_names_are_the_library_s():
    """The choices and defaults the options show come from qstream.cli (no heavy imports);
    each must be the constant the library itself uses."""
    from qstream import cli as light
    from qstream.calibration import CALIBRATION_BLOCKS
    from qstream.capture.target import DTYPES
    from qstream.card.build import FORMATS as CARD_FORMATS
    from qstream.eval.sensitivity import DEFAULT_FORMAT
    from qstream.eval.settings import DEFAULT_EDGES
    from qstream.eval.states import AUTO, CONVENTIONS, LAYOUTS
    from qstream.eval.states.layouts import EXPORTS
    from qstream.eval.vocabulary import VARIANT_FORMATS
    from qstream.formats import FORMATS
    from qstream.vllm.loader import VLLM_VERSION

    assert light.WEIGHT_FORMATS == tuple(FORMATS)
    assert light.VARIANT_FORMATS == VARIANT_FORMATS
    assert light.DEFAULT_EDGES == DEFAULT_EDGES
    assert light.SENSITIVITY_FORMAT == DEFAULT_FORMAT
    assert (light.STATES_AUTO, light.STATES_FORMATS) == (AUTO, tuple(LAYOUTS))
    assert light.LAYER_CONVENTIONS == tuple(CONVENTIONS)
    assert light.CAPTURE_DTYPES == tuple(DTYPES)
    assert light.CAPTURE_EXPORTS == tuple(EXPORTS)
    assert light.CARD_FORMATS == tuple(CARD_FORMATS)
    assert light.VLLM_VERSION == VLLM_VERSION
    assert light.CALIBRATION_BLOCKS == CALIBRATION_BLOCKS


def test_a_default_regime_or_format_in_a_help_text_is_read_from_its_registry():
    """ "Default: heavy" is written from qstream.regimes.DEFAULT_REGIME (and a default format
    from the names qstream.cli holds), never spelled in a command's source."""
    import ast
    from pathlib import Path

    from qstream import cli as light
    from qstream.regimes import DEFAULT_REGIME, REGIMES
    from qstream.serving import TOKEN_WEIGHTS

    names = {*REGIMES, *TOKEN_WEIGHTS}
    spelled = [
        f"{path.name}:{node.lineno}: {node.value!r}"
        for path in sorted((Path(light.__file__).parent / "commands").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if any(f"default: {name}" in node.value.lower() for name in names)
    ]
    assert spelled == []
    ctx = click.Context(cli)
    helps = {p.name: p.help for p in cli.get_command(ctx, "eval-drift").params}
    assert f"Default: {DEFAULT_REGIME.name}, or none" in helps["regime"]
    assert f"Default: {light.SENSITIVITY_FORMAT}, or" in helps["sensitivity_format"]
