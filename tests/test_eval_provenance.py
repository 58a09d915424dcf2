"""eval-drift checks the role of each checkpoint (qstream/eval/variants.py): a quantized
--model is refused (it would be its own reference), a --variant not derived from the --model is
refused, or with --allow-foreign-variant compared and labelled foreign in the JSON and the card."""

import json
import shutil

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from qstream.arch.dspark_mla import QUANTIZE_INCLUDE
from qstream.cli import cli


def _run(args: list[str]):
    return CliRunner().invoke(cli, args)


def _one_error(result) -> str:
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def _quantize(model, out, fmt="fp8"):
    result = _run(
        [
            "quantize",
            "--model_dir",
            str(model),
            "--output_dir",
            str(out),
            "--quant_format",
            fmt,
            "--include_layers",
            *QUANTIZE_INCLUDE,
        ]
    )
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory):
    return _quantize(tiny, tmp_path_factory.mktemp("q") / "fp8")


@pytest.fixture(scope="module")
def foreign(tiny, tmp_path_factory):
    """Another model with the same config (every norm weight changed), quantized."""
    root = tmp_path_factory.mktemp("foreign")
    shutil.copytree(tiny, root / "other")
    tensors = load_file(root / "other" / "model.safetensors")
    for name in [n for n in tensors if "norm" in n]:
        tensors[name] = tensors[name] * 1.5
    save_file(tensors, root / "other" / "model.safetensors")
    return _quantize(root / "other", root / "other-fp8")


def test_a_quantized_model_is_refused_pointing_to_variant(quantized):
    err = _one_error(_run(["eval-drift", "--model", str(quantized), "--blocks", "8"]))
    assert f"--model {quantized} is a quantized checkpoint" in err
    assert "quantization_config" in err and f"--variant NAME={quantized}" in err


def test_quantized_tensors_are_refused_without_a_quantization_config(quantized, tmp_path):
    stripped = tmp_path / "stripped"
    shutil.copytree(quantized, stripped)
    config = json.loads((stripped / "config.json").read_text())
    del config["quantization_config"]
    (stripped / "config.json").write_text(json.dumps(config))
    err = _one_error(_run(["eval-drift", "--model", str(stripped), "--blocks", "8"]))
    assert "stores quantized tensors, e.g. " in err and ".weight_scale" in err


def test_a_variant_of_another_model_is_refused(tiny, foreign):
    err = _one_error(
        _run(
            [
                "eval-drift",
                "--model",
                tiny,
                "--blocks",
                "8",
                "--formats",
                "bf16",
                "--variant",
                f"shipped={foreign}",
            ]
        )
    )
    assert f"--variant shipped: {foreign} is not derived from --model {tiny}" in err
    assert "--allow-foreign-variant" in err


def test_a_derived_variant_is_not_foreign(tiny, quantized, tmp_path):
    out = tmp_path / "r.json"
    result = _run(
        [
            "eval-drift",
            "--model",
            tiny,
            "--blocks",
            "8",
            "--regime",
            "gauss",
            "--formats",
            "bf16",
            "--variant",
            f"shipped={quantized}",
            "--json",
            str(out),
        ]
    )
    assert result.exit_code == 0, result.output
    assert "foreign" not in json.loads(out.read_text())["variants"]["shipped"]


def test_an_allowed_foreign_variant_is_labelled_in_json_and_card(tiny, foreign, tmp_path):
    out = tmp_path / "r.json"
    result = _run(
        [
            "eval-drift",
            "--model",
            tiny,
            "--blocks",
            "8",
            "--regime",
            "gauss",
            "--formats",
            "bf16",
            "--variant",
            f"shipped={foreign}",
            "--allow-foreign-variant",
            "--json",
            str(out),
        ]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["variants"]["shipped"]["foreign"] is True
    card = tmp_path / "CARD.md"
    result = _run(["card", str(out), "--output", str(card), "--no-figures"])
    assert result.exit_code == 0, result.output
    assert "**Foreign variant(s): shipped.**" in card.read_text()


def test_the_builtin_corpus_is_the_shipped_gsm8k_test_split():
    from qstream.eval.corpus import BUILTIN_CORPUS, builtin_corpus_docs

    docs = builtin_corpus_docs()
    assert len(docs) == 1319 and "\n#### " in docs[0]  # GSM8K test: 1,319 problems
    assert (BUILTIN_CORPUS.parent / "GSM8K_LICENSE").read_text().startswith("MIT License")
