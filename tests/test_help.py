"""Every option of every command says what it does (docs/quantize.md: the help is the
reference a user reads first)."""

import click

from qstream.cli import cli


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
