"""Loading the Hugging Face target that speculate and capture run (qstream/capture/target.py)
and decoding with it: a target or draft with NaN or Inf, a checkpoint whose tensors do not fit
its config, a target without its tokenizer, more prompts than the corpus holds, more positions
than the target has, a seed torch cannot take — each is one ``Error:`` line (or a usage error)
naming what, never a traceback, a silent fill-in or a result (docs/guarantees.md).  The
defaults suit the machine (float32 on a CPU) and transformers' own loading chatter stays out of
the output.  A tiny transformers Qwen3 target and a draft synthesized for it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import cli_ok
from click.testing import CliRunner
from hf_targets import make_qwen3_target
from safetensors.torch import load_file, save_file

from qstream.cli import cli
from qstream.cliutil import SEED_MAX

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """Tiny models: torch's intra-op threads cost more than they gain on a shared machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, draft, a one-document corpus), read-only: tests corrupt copies."""
    root = tmp_path_factory.mktemp("pair")
    target = make_qwen3_target(root / "target")
    draft = root / "draft"
    cli_ok(["synth", "--target", str(target), "--output_dir", str(draft)])
    corpus = root / "one.jsonl"
    corpus.write_text(json.dumps({"question": QUESTION, "answer": "7\n#### 7"}) + "\n")
    return target, draft, corpus


def _speculate(pair, target=None, draft=None, *extra: str) -> list[str]:
    t, d, corpus = pair
    return ["speculate", "--target", str(target or t), "--model", str(draft or d),
            "--corpus", str(corpus), "--prompts", "1", "--new-tokens", "4", "--formats", "bf16",
            *extra]  # fmt: skip


def _capture(pair, out: Path, target=None, *extra: str) -> list[str]:
    t, d, corpus = pair
    return ["capture", "--target", str(target or t), "--model", str(d), "--output", str(out),
            "--corpus", str(corpus), "--streams", "1", "--max-tokens", "12", *extra]  # fmt: skip


def _copy(source: Path, tmp_path: Path, name: str = "copy") -> Path:
    return Path(shutil.copytree(source, tmp_path / name))


def _edit(directory: Path, edit) -> None:
    """``edit(tensors)`` applied to the directory's model.safetensors, rewritten in place."""
    tensors = load_file(directory / WEIGHTS)
    edit(tensors)
    save_file(tensors, directory / WEIGHTS, metadata={"format": "pt"})


def _poke(name: str, value: float):
    def edit(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = value

    return edit


def test_the_largest_seed_decodes_and_one_more_is_a_usage_error(pair, tmp_path):
    assert SEED_MAX == 2**63 - 1
    args = [*_speculate(pair), "--rule", "probabilistic", "--json", "-"]
    results = json.loads(cli_ok([*args, "--seed", str(SEED_MAX)]).stdout)
    assert results["settings"]["seed"] == SEED_MAX
    cli_ok(_capture(pair, tmp_path / "gen", None, "--generate", "--new-tokens", "2",
                    "--seed", str(SEED_MAX)))  # fmt: skip
    for command in (args, _capture(pair, tmp_path / "no", None, "--generate"),
                    ["formats", "--json", "-"]):  # fmt: skip
        result = CliRunner().invoke(cli, [*command, "--seed", str(SEED_MAX + 1)])
        assert result.exit_code == 2 and "--seed" in result.stderr, result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "no").exists()
