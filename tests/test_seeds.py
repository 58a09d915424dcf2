"""``--seed`` takes every value torch's generators can be seeded with once a run has folded in
its own offsets, in every command that has it, and nothing beyond: the largest runs, one more
is click's usage error (docs/guarantees.md, "Exit statuses"), never an overflow traceback."""

from __future__ import annotations

import pytest
from cli_helpers import cli_ok
from click.testing import CliRunner

from qstream.cli import SEED_MAX, cli


def test_synth_takes_the_largest_seed(tmp_path):
    cli_ok(
        ["synth", "--preset", "tiny", "--output_dir", str(tmp_path / "d"), "--seed", str(SEED_MAX)]
    )


def test_eval_drift_takes_the_largest_seed(tiny, tmp_path):
    cli_ok(["eval-drift", "--model", str(tiny), "--regime", "all", "--blocks", "4",
            "--formats", "bf16", "--acceptance", "--seed", str(SEED_MAX),
            "--json", str(tmp_path / "r.json")])  # fmt: skip


@pytest.mark.parametrize("command", ["synth", "eval-drift"])
def test_one_more_is_a_usage_error(command, tmp_path):
    result = CliRunner().invoke(cli, [command, "--seed", str(SEED_MAX + 1)])
    assert result.exit_code == 2 and "--seed" in result.output, result.output
