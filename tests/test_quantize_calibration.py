"""quantize --calibration end to end (docs/quantize.md, "Calibration"): on both tiny drafts the
stored input scales are compressed-tensors' of the amax the FP32 reference observed over the
named set; the set and its size are recorded and verify reads them; the same seed writes the
same bytes and another seed other scales; captured states give their first rows; bad input
is one Error line with nothing written."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import as_bytes, tree_digest
from cli_helpers import cli_error, cli_ok
from safetensors.torch import load_file, save_file
from stand_in_target import capture_states
from test_quantize_schemes import PRESETS, observed_scale

from qstream.calibration import CalibrationSet, first_rows
from qstream.eval.corpus import Corpus
from qstream.publish import QUANTIZE_RECORD
from qstream.vllm.profiles import fused_groups, profile_for
from qstream.vllm.verify import verify_checkpoint

BLOCKS = "8"  # small sets: the tiny drafts calibrate in a fraction of a second


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3") / "draft"
    cli_ok(["synth", "--preset", "qwen3-tiny", "--output_dir", str(out)])
    return out


@pytest.fixture(scope="module")
def observed(tiny, qwen3):
    """Each draft's gauss calibration, as quantize --calibration gauss runs it (its amaxes are
    the linear inputs' maxima: tests/test_calibration.py)."""
    drafts = {"tiny": Path(tiny), "qwen3": qwen3}
    return {a: (d, CalibrationSet("gauss", blocks=int(BLOCKS)).run(d)) for a, d in drafts.items()}


def _quantize(draft, out, *extra) -> list[str]:
    return ["quantize", "--model_dir", str(draft), "--output_dir", str(out), *extra]


def _summary(out) -> dict:
    return json.loads((out / QUANTIZE_RECORD).read_text())["summary"]


@pytest.mark.parametrize("activations", ["fp8-static", "nvfp4"])
@pytest.mark.parametrize("arch", ["tiny", "qwen3"])
def test_stored_scales_are_compressed_tensors_of_the_observed_amax(
    observed, tmp_path, arch, activations
):
    draft, calibration = observed[arch]
    fmt, preset = PRESETS[activations]
    out = tmp_path / "out"
    cli_ok(_quantize(draft, out, "--quant_format", fmt, "--activations", activations,
                     "--calibration", "gauss", "--calibration-blocks", BLOCKS))  # fmt: skip
    source, written = load_file(draft / "model.safetensors"), load_file(out / "model.safetensors")
    summary = _summary(out)
    quantized = summary["modules_quantized"]
    profile = profile_for(json.loads((draft / "config.json").read_text()))
    # a fused layer (gate/up; q/k/v; K3: q_a/kv_a of every layer) keeps one scale, the largest
    group_of = {m: g.members for g in fused_groups(quantized, profile) for m in g.members}
    assert group_of
    for module in quantized:
        amax = max(float(calibration.input_amax(m)) for m in group_of.get(module, (module,)))
        name, expected = observed_scale(preset, amax, source[f"{module}.weight"].dtype)
        stored = written[f"{module}.{name}"]
        assert stored.dtype == expected.dtype and as_bytes(stored) == as_bytes(expected), module
    assert set(summary["serving"]) == {"activations", "calibration"}
    recorded = summary["serving"]["calibration"]
    assert recorded == calibration.source
    assert recorded["regime"] == "gauss" and recorded["blocks"] == int(BLOCKS)
    assert recorded["tokens"] > int(BLOCKS) * 7  # the blocks and their contexts
    assert verify_checkpoint(out).ok


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_scales(qwen3, tmp_path):
    def args(out, seed):
        return _quantize(qwen3, out, "--quant_format", "nvfp4", "--activations", "nvfp4",
                         "--calibration", "heavy", "--calibration-blocks", BLOCKS, "--seed",
                         str(seed))  # fmt: skip

    out, other = tmp_path / "out", tmp_path / "other"
    cli_ok(args(out, 3))
    first = tree_digest(out)
    cli_ok([*args(out, 3), "--overwrite"])
    assert tree_digest(out) == first
    cli_ok(args(other, 4))
    a, b = load_file(out / "model.safetensors"), load_file(other / "model.safetensors")
    scales = [n for n in a if n.endswith(".input_global_scale")]
    assert scales and any(as_bytes(a[n]) != as_bytes(b[n]) for n in scales)
    assert all(as_bytes(a[n]) == as_bytes(b[n]) for n in a if n not in scales)
    recorded = json.loads((out / QUANTIZE_RECORD).read_text())["command"]
    assert recorded.endswith("--calibration heavy --calibration-blocks 8 --seed 3")


def test_captured_states_calibrate_on_their_first_rows(tiny, tmp_path):
    states = tmp_path / "captured"  # a directory of states files, as qstream capture writes
    states.mkdir()
    capture_states(str(tiny), str(states / "rows.safetensors"), n_streams=4, length=40, seed=0)
    out = tmp_path / "out"
    cli_ok(_quantize(tiny, out, "--quant_format", "fp8", "--activations", "fp8-static",
                     "--calibration", str(states), "--calibration-blocks", "3"))  # fmt: skip
    recorded = _summary(out)["serving"]["calibration"]
    assert recorded["captured"] == str(states) and recorded["rows"] == recorded["blocks"] == 3
    # each row drafted at its last anchor, 40 - 7 - 1: its context and its block of 7
    assert recorded["tokens"] == 3 * (40 - 7 - 1 + 7)
    assert verify_checkpoint(out).ok


def test_first_rows_takes_one_block_per_row_at_its_last_anchor_skipping_short_rows():
    streams = tuple(torch.zeros(n, dtype=torch.int64) for n in (5, 20, 9, 30, 40))
    plan = first_rows(Corpus("c", "", streams), 3, block_size=7, max_anchor=15)
    assert plan.stream.tolist() == [1, 2, 3] and plan.anchor.tolist() == [12, 1, 15]
    with pytest.raises(Exception, match="no row holds a block of 7 tokens"):
        first_rows(Corpus("c", "", streams[:1]), 3, block_size=7, max_anchor=15)


def test_an_unknown_source_is_refused_naming_it(qwen3, tmp_path):
    message = cli_error(_quantize(qwen3, tmp_path / "out", "--quant_format", "fp8",
                                  "--activations", "fp8-static", "--calibration", "nowhere"))  # fmt: skip
    assert "--calibration nowhere: neither a regime (gauss, heavy, boot) nor captured" in message
    assert not (tmp_path / "out").exists()


def test_a_non_finite_activation_is_one_error_line_and_nothing_is_written(tiny, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    tensors = load_file(bad / "model.safetensors")
    norm = "layers.0.post_attention_layernorm.weight"
    tensors[norm] = torch.full_like(tensors[norm], 3e38)  # finite in bf16, overflows after
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    message = cli_error(_quantize(bad, tmp_path / "out", "--quant_format", "fp8",
                                  "--activations", "fp8-static", "--calibration", "gauss",
                                  "--calibration-blocks", BLOCKS))  # fmt: skip
    assert "the linear inputs of layers.0.mlp.gate_proj hold NaN or Inf" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_kv_cache_scheme_from_the_command_line_stores_each_layers_calibrated_scales(
    observed, tmp_path
):
    """--kv-cache-scheme fp8 --calibration gauss: each attention's k_scale / v_scale is
    compressed-tensors' ``amax / 448`` of what its cache stored over the set (K after k_norm and
    RoPE, and V), in the weight dtype; verify passes."""
    draft, calibration = observed["qwen3"]
    out = tmp_path / "out"
    cli_ok(_quantize(draft, out, "--quant_format", "fp8", "--kv-cache-scheme", "fp8",
                     "--calibration", "gauss", "--calibration-blocks", BLOCKS))  # fmt: skip
    written = load_file(out / "model.safetensors")
    attentions = sorted({n.rsplit(".", 1)[0] for n in written if n.endswith(".k_scale")})
    assert attentions and all(f"{a}.v_scale" in written for a in attentions)
    for attention in attentions:
        k, v = calibration.kv_amax(attention)
        dtype = written[f"{attention}.q_proj.weight_scale"].dtype
        for name, amax in (("k_scale", k), ("v_scale", v)):
            observed_amax = amax.reshape(1).to(dtype)
            expected = observed_amax / torch.tensor(448.0, dtype=dtype)
            stored = written[f"{attention}.{name}"]
            assert stored.dtype == dtype and as_bytes(stored) == as_bytes(expected), attention
    assert _summary(out)["serving"]["kv_cache_scheme"] == "fp8"
    assert verify_checkpoint(out).ok
