"""A target as llama.cpp users have it, one GGUF file (docs/capture.md, "A GGUF target"):
``qstream convert-gguf`` makes it the transformers directory every ``--target`` takes, with the
tensors transformers reads from the file; a GGUF file given as ``--target`` names the command;
a bad file or a missing ``gguf`` package is one line."""

import json
import sys

import pytest
import torch
from cli_helpers import cli_error, cli_ok
from click.testing import CliRunner
from hf_targets import make_gguf_target
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qstream.cli import cli
from qstream.publish import CONVERT_RECORD

pytest.importorskip("gguf", reason="convert-gguf reads GGUF files with the gguf package")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    """(folder holding tiny-llama.gguf, the transformers directory it was written from)"""
    directory = tmp_path_factory.mktemp("gguf")
    return directory, make_gguf_target(directory)


@pytest.fixture(scope="module")
def converted(gguf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "target"
    cli_ok(["convert-gguf", str(gguf_dir[0] / "tiny-llama.gguf"), "--output_dir", str(out)])
    return out


def test_converted_target_holds_the_source_models_tensors(gguf_dir, converted):
    """Written as llama.cpp writes it (q/k permuted) and read back by transformers, every
    tensor is the source model's, bit for bit, under its transformers name."""
    source = AutoModelForCausalLM.from_pretrained(gguf_dir[1], dtype=torch.float32)
    stored = load_file(converted / "model.safetensors")
    assert set(stored) == set(source.state_dict())
    for name, tensor in source.state_dict().items():
        assert torch.equal(stored[name], tensor), name
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config


def test_converted_target_runs_through_synth_and_tokenizes_alike(gguf_dir, converted, tmp_path):
    from tokenizers import Tokenizer

    text = "Natalia sold clips to 48 of her friends in April."
    source = Tokenizer.from_file(str(gguf_dir[1] / "tokenizer.json"))
    mine = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert mine.encode(text).ids == source.encode(text).ids
    cli_ok(["synth", "--target", str(converted), "--output_dir", str(tmp_path / "draft")])
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["vocab_size"] == 512


def test_folder_of_one_gguf_file_is_taken_and_replaced_with_overwrite(gguf_dir, tmp_path):
    args = ["convert-gguf", str(gguf_dir[0]), "--output_dir", str(tmp_path / "t")]
    cli_ok(args)
    assert "already exists" in cli_error(args)
    cli_ok([*args, "--overwrite"])
    record = json.loads((tmp_path / "t" / CONVERT_RECORD).read_text())
    assert record["source"] == "tiny-llama.gguf"


@pytest.mark.parametrize("command", ["synth", "capture", "eval-drift", "speculate"])
def test_gguf_as_target_names_the_conversion(gguf_dir, command):
    result = CliRunner().invoke(cli, [command, "--target", str(gguf_dir[0])])
    assert result.exit_code == 2, result.output
    assert "a GGUF target; convert it once with qstream convert-gguf" in result.stderr


def test_bad_gguf_file_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    message = cli_error(["convert-gguf", str(bad), "--output_dir", str(tmp_path / "out")])
    assert str(bad) in message and "not a readable GGUF file" in message
    assert not (tmp_path / "out").exists()


def test_gguf_file_transformers_cannot_load_is_one_line_naming_it(tmp_path):
    """A well-formed GGUF file (gguf reads it) of an architecture transformers does not map."""
    import gguf
    import numpy as np

    file = tmp_path / "nonesuch.gguf"
    writer = gguf.GGUFWriter(str(file), "nonesuch")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = cli_error(["convert-gguf", str(file), "--output_dir", str(tmp_path / "out")])
    assert f"{file}: transformers cannot load it" in message and "nonesuch" in message
    assert not (tmp_path / "out").exists()


def test_folder_of_two_gguf_files_is_refused(gguf_dir, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes((gguf_dir[0] / "tiny-llama.gguf").read_bytes())
    message = cli_error(["convert-gguf", str(tmp_path), "--output_dir", str(tmp_path / "out")])
    assert "holds 2 .gguf files (a.gguf, b.gguf)" in message


def test_missing_gguf_package_is_one_line(gguf_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    source = gguf_dir[0] / "tiny-llama.gguf"
    message = cli_error(["convert-gguf", str(source), "--output_dir", str(tmp_path / "out")])
    assert "pip install 'qstream[gguf]'" in message and str(source) in message
