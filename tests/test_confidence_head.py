"""The confidence head as vLLM 0.32 builds and runs it (docs/model.md): its width follows
``confidence_head_with_markov`` (default false: [1, H]), it is computed in fp32 from model-dtype
inputs in every variant, it is never quantized, and a checkpoint whose head vLLM would build
at another width is refused by the loader and reported by ``verify``."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoints import DSPARK_RECIPE
from model_helpers import random_model_weights

from qstream.arch.dspark_mla import PRESETS, DSparkConfig, tensor_shapes
from qstream.arch.dspark_mla.model import DSpark, load_model
from qstream.arch.markov import confidence
from qstream.errors import QStreamError
from qstream.formats import FORMATS, quantize
from qstream.publish import QUANTIZE_RECORD
from qstream.quant import quantize_checkpoint
from qstream.synth.draft import _small_tensors
from qstream.vllm.verify import verify_checkpoint

TINY = PRESETS["tiny"]
H, R = TINY.hidden_size, TINY.markov_rank
HEAD = "confidence_head.proj.weight"


def _without_key(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "confidence_head_with_markov"}


# --- config and tensor table -------------------------------------------------------------------


def test_key_defaults_to_vllms_false_and_presets_set_it():
    assert DSparkConfig.from_json(_without_key(TINY.to_json())).confidence_head_with_markov is False
    for name, preset in PRESETS.items():
        assert preset.confidence_head_with_markov is True, name
        assert preset.to_json()["confidence_head_with_markov"] is True, name
    with pytest.raises(ValueError, match="confidence_head_with_markov = 1 must be true or false"):
        DSparkConfig.from_json({**TINY.to_json(), "confidence_head_with_markov": 1})


def test_head_width_follows_the_key():
    narrow = replace(TINY, confidence_head_with_markov=False)
    assert tensor_shapes(TINY)[HEAD] == (1, H + R)
    assert tensor_shapes(narrow)[HEAD] == (1, H)
    assert HEAD not in tensor_shapes(replace(TINY, enable_confidence_head=False))


def test_synth_writes_the_key_and_the_head_it_describes(tiny):
    config = json.loads(Path(tiny, "config.json").read_text())
    assert config["confidence_head_with_markov"] is True
    assert tuple(load_model(tiny).w.stored[HEAD].shape) == (1, H + R)
    w1, w2 = torch.randn(TINY.vocab_size, R), torch.randn(TINY.vocab_size, R)
    wide = _small_tensors(TINY, 0, w1, w2)[HEAD]
    narrow = _small_tensors(replace(TINY, confidence_head_with_markov=False), 0, w1, w2)[HEAD]
    assert tuple(narrow.shape) == (1, H)
    assert torch.equal(narrow, wide[:, :H])  # the same hidden-state columns, drawn first


def test_wide_head_without_the_key_fails_loading_naming_tensor_shape_and_key(tiny, tmp_path):
    bad = shutil.copytree(tiny, tmp_path / "bad")
    config = json.loads(Path(bad, "config.json").read_text())
    Path(bad, "config.json").write_text(json.dumps(_without_key(config)))
    with pytest.raises(QStreamError) as caught:
        load_model(bad)
    message = str(caught.value)
    assert "\n" not in message
    assert f"'{HEAD}' has shape [1, {H + R}], expected [1, {H}]" in message
    assert "confidence_head_with_markov: true" in message


# --- computed as vLLM runs it -------------------------------------------------------------------


def _vllm_head(weights, config, hf, prev, dtype):
    """vLLM 0.32's DSparkConfidenceHead.forward + compute_confidence, written out: hf and
    markov_w1[prev] in the model's dtype, concatenated there, .float(), fp32 proj, sigmoid."""
    x = hf.to(dtype)
    if config.confidence_head_with_markov:
        emb = weights["markov_head.markov_w1.weight"].to(dtype)[prev]
        x = torch.cat([x, emb], dim=-1)
    weight = weights[HEAD].to(dtype).float()  # a bf16 checkpoint's value, in an fp32 parameter
    bias = weights["confidence_head.proj.bias"].to(dtype).float()
    return torch.sigmoid(F.linear(x.float(), weight, bias)).squeeze(-1)


@pytest.mark.parametrize("with_markov", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_confidence_is_fp32_from_model_dtype_inputs(with_markov, dtype):
    config = replace(TINY, confidence_head_with_markov=with_markov)
    weights = random_model_weights(config, seed=2)
    model = DSpark(config, weights, dtype)
    gen = torch.Generator().manual_seed(3)
    hf = torch.randn(5, config.block_size, H, generator=gen)
    prev = torch.randint(0, config.vocab_size, (5, config.block_size), generator=gen)
    got = confidence(model, hf, prev)
    assert got is not None and got.dtype == torch.float32
    expected = _vllm_head(weights, config, hf, prev, dtype)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_fp32_reference_confidence_is_what_it_was():
    """The FP32 reference's head is computed as before this change: an fp32 [hf ; emb] times
    the fp32 head."""
    weights = random_model_weights(TINY, seed=4)
    model = DSpark(TINY, weights)
    gen = torch.Generator().manual_seed(5)
    hf = torch.randn(4, TINY.block_size, H, generator=gen)
    prev = torch.randint(0, TINY.vocab_size, (4, TINY.block_size), generator=gen)
    feats = torch.cat((hf, weights["markov_head.markov_w1.weight"][prev]), dim=-1)
    before = torch.sigmoid(
        F.linear(feats, weights[HEAD], weights["confidence_head.proj.bias"])
    ).squeeze(-1)
    torch.testing.assert_close(confidence(model, hf, prev), before, rtol=0, atol=0)


# --- never quantized; verify checks the width ---------------------------------------------------


def test_quantize_refuses_to_quantize_the_head(tiny, tmp_path):
    with pytest.raises(
        QStreamError, match="confidence_head.proj, which vLLM cannot serve quantized"
    ):
        quantize_checkpoint(tiny, tmp_path / "q", "fp8", include=["confidence_head.proj"])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_stored_shapes_are_what_the_format_stores(fmt):
    w = torch.randn(48, 96, dtype=torch.bfloat16)
    stored = quantize(fmt, w)
    assert tuple(stored) == FORMATS[fmt].stored
    assert FORMATS[fmt].stored_shapes(48, 96) == {k: tuple(v.shape) for k, v in stored.items()}


@pytest.fixture(scope="module")
def quantized_tiny(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("conf") / "nvfp4"
    return quantize_checkpoint(tiny, out, "nvfp4", include=DSPARK_RECIPE).output_dir


def _edited(quantized, tmp_path, edit):
    out = Path(shutil.copytree(quantized, tmp_path / "edited"))
    (out / QUANTIZE_RECORD).unlink()  # another tool's edit: the recorded sha256s are tested apart
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(edit(config)))
    return out


def test_verify_passes_a_head_vllm_builds_at_its_width(quantized_tiny):
    report = verify_checkpoint(quantized_tiny)
    assert report.ok, report.problems


def test_verify_reports_a_wide_head_without_the_key(quantized_tiny, tmp_path):
    report = verify_checkpoint(_edited(quantized_tiny, tmp_path, _without_key))
    shape_lines = [p for p in report.problems if p.startswith(HEAD)]
    assert len(shape_lines) == 1, report.problems
    assert shape_lines[0].startswith(
        f"{HEAD}: stored [1, {H + R}], vLLM builds [1, {H}] from config.json"
    )
    assert "confidence_head_with_markov: true" in shape_lines[0]


def test_verify_checks_quantized_weights_by_their_stored_shapes(quantized_tiny, tmp_path):
    """A config whose intermediate_size is not the checkpoint's: each MLP tensor is named with
    its stored shape and the one the format stores for the config's [N, K]."""
    report = verify_checkpoint(
        _edited(quantized_tiny, tmp_path, lambda c: {**c, "intermediate_size": 128})
    )
    block = FORMATS["nvfp4"].block_size
    for line in (
        f"layers.0.mlp.down_proj.weight_packed: stored [{H}, 48], vLLM builds [{H}, 64]",
        f"layers.0.mlp.down_proj.weight_scale: stored [{H}, {96 // block}], vLLM builds "
        f"[{H}, {128 // block}]",
        "layers.4.mlp.gate_proj.weight_packed: stored [96, 32], vLLM builds [128, 32]",
    ):
        assert any(p.startswith(line) for p in report.problems), (line, report.problems)
    assert not any("weight_global_scale" in p for p in report.problems)
