"""Like mistakes exit alike, in every command (docs/guarantees.md, "Exit statuses"):

* **2, a usage error**: the command line itself is wrong (an unknown command or option, a
  missing option or argument, a value that is not of the option's type, not one of its
  choices, or out of its range).  click's message: a usage line, a hint, a blank line and
  ``Error: …`` naming the option, as every click tool prints it.
* **1, one line** ``Error: …``: the command line is well formed but what it names is wrong (a
  missing or malformed file, a pattern that matches nothing, a device this machine lacks).

Nothing is written in either case."""

import pytest
import torch
from checkpoints import llama_tensors, write_checkpoint
from click.testing import CliRunner

from qstream.cli import cli
from qstream.commands.quantize import quantize

Q = ["quantize", "--model_dir", "in", "--output_dir", "out", "--quant_format", "fp8"]
CAPTURE = ["capture", "--target", "t", "--model", "m", "--output", "o"]
SYNTH = ["synth", "--output_dir", "out"]

# name -> (arguments, the option or text the Error line names)
USAGE_ERRORS = {
    "unknown command": (["quantise"], "No such command 'quantise'"),
    "unknown option": ([*Q, "--bogus"], "--bogus"),
    "missing option": (Q[:5], "--quant-format"),
    "missing argument": (["card", "--output", "CARD.md"], "RESULTS"),
    "not an integer": ([*Q, "--workers", "two"], "--workers"),
    "workers 0": ([*Q, "--workers", "0"], "--workers"),
    "tensor parallel 0": ([*Q, "--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    "unknown format": ([*Q[:-1], "int3"], "--quant-format"),
    "quantize device": ([*Q, "--device", "gpu"], "--device"),
    "verify tensor parallel 0": (["verify", "d", "--tensor-parallel-size", "0"], "--tensor"),
    "negative target layers": (["verify", "d", "--target-layers", "-1"], "--target-layers"),
    "unknown preset": ([*SYNTH, "--preset", "huge"], "--preset"),
    "synth negative seed": ([*SYNTH, "--seed", "-1"], "--seed"),
    "synth device": ([*SYNTH, "--device", "gpu"], "--device"),
    "formats negative seed": (["formats", "--seed", "-1"], "--seed"),
    "capture max tokens 0": ([*CAPTURE, "--max-tokens", "0"], "--max-tokens"),
    "capture device": ([*CAPTURE, "--device", "cuda:x"], "--device"),
    "blocks 0": (["eval-drift", "--blocks", "0"], "--blocks"),
    "top-p 2": (["eval-drift", "--top-p", "2"], "--top-p"),
    "temperature nan": (["eval-drift", "--temperature", "nan"], "--temperature"),
    "unknown regime": (["eval-drift", "--regime", "none"], "--regime"),
    "unknown variant format": (["eval-drift", "--formats", "bf16,int3"], "--formats"),
    "variant without a name": (["eval-drift", "--variant", "draft-fp8"], "--variant"),
    "decreasing edges": (["eval-drift", "--context-lengths", "64,32"], "--context-lengths"),
    "edges not numbers": (["eval-drift", "--context-lengths", "a,b"], "--context-lengths"),
    "layer ids not numbers": (["eval-drift", "--states-layer-ids", "a,b"], "--states-layer-ids"),
    "eval-drift device": (["eval-drift", "--device", "gpu"], "--device"),
    "unknown card format": (["card", "r.json", "--output", "C.md", "--format", "pdf"], "--format"),
}


@pytest.mark.parametrize("case", list(USAGE_ERRORS))
def test_a_wrong_command_line_is_a_usage_error(tmp_path, monkeypatch, case):
    args, named = USAGE_ERRORS[case]
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, args, prog_name="qstream")
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert lines[0].startswith("Usage: qstream") and lines[1].startswith("Try 'qstream"), lines
    assert lines[2:-1] == [""] and lines[-1].startswith("Error: ") and named in lines[-1], lines
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


def test_qstream_quantize_alone_has_the_same_usage_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(quantize, [*Q[1:], "--workers", "0"], prog_name="qstream-quantize")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[0].startswith("Usage: qstream-quantize")
    assert "--workers" in result.stderr.splitlines()[-1]


# name -> (arguments with {ckpt} an existing checkpoint, text of the Error line)
INPUT_ERRORS = {
    "no input directory": (Q, "--model_dir in: not a directory"),
    "pattern matches nothing": (
        [
            "quantize",
            "--model_dir",
            "{ckpt}",
            "--output_dir",
            "out",
            "--quant_format",
            "fp8",
            "--include_layers",
            "mlp.gate_prj",
        ],
        "matches no module",
    ),  # fmt: skip
    "inspect: no directory": (["inspect", "missing"], "missing"),
    "verify: no directory": (["verify", "missing"], "missing"),
    "variant directory missing": (["eval-drift", "--variant", "x=missing"], "missing"),
    "draft directory missing": (["eval-drift", "--model", "missing"], "missing"),
    "no format and no variant": (["eval-drift", "--formats", ""], "nothing to evaluate"),
    "results file missing": (["card", "missing.json", "--output", "C.md"], "missing.json"),
    "json into a missing directory": (["formats", "--json", "no/dir/f.json"], "--json"),
    "synth over a foreign directory": (["synth", "--output_dir", "{ckpt}"], "{ckpt}"),
}


@pytest.mark.parametrize("case", list(INPUT_ERRORS))
def test_a_mistake_in_what_the_options_name_is_one_line(tmp_path, monkeypatch, case):
    args, message = INPUT_ERRORS[case]
    write_checkpoint(tmp_path / "ckpt", llama_tensors(layers=1))
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(cli, [a.format(ckpt="ckpt") for a in args])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and result.stdout == "", result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), lines
    assert message.format(ckpt="ckpt") in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="a device this machine lacks")
def test_a_device_this_machine_lacks_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, [*SYNTH, "--device", "cuda"])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
    assert result.stderr.startswith("Error: --device cuda")
