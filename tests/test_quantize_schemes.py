"""quantize's activation and KV-cache schemes (docs/quantize.md, "Activation and KV-cache
schemes"): the config compressed-tensors' presets describe, the weights untouched, the
calibrated scales bit-exact with compressed-tensors' own formulas, the record, verify's checks,
and every bad combination refused with one line and nothing written.  vLLM's side is
tests/test_vllm_schemes.py (the vLLM lane)."""

import json

import pytest
import torch
from checkpoints import (
    as_bytes,
    dspark_config,
    dspark_tensors,
    llama_tensors,
    tree_digest,
    write_checkpoint,
)
from cli_helpers import cli_error
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from safetensors.torch import load_file, save_file

from qstream.calibration import KV_CACHE, LINEAR_INPUTS, Calibration
from qstream.publish import QUANTIZE_RECORD
from qstream.quant import quantize_checkpoint
from qstream.quant.schemes import input_scale
from qstream.serving import ACTIVATIONS
from qstream.vllm.profiles import fused_groups
from qstream.vllm.verify import verify_checkpoint

# activations -> (weight format, the compressed-tensors preset whose input_activations it is)
PRESETS = {
    "fp8-dynamic": ("fp8", "FP8_DYNAMIC"),
    "fp8-static": ("fp8", "FP8"),
    "nvfp4": ("nvfp4", "NVFP4"),
}
KV_ARGS = QuantizationArgs(
    num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False
)


def _modules(tensors) -> list[str]:
    return [n.removesuffix(".weight") for n in tensors if n.endswith(".weight")]


SOURCE = {"regime": "gauss", "drawn": "given in the test", "blocks": 12, "tokens": 96}


def _attention(tensors) -> list[str]:
    return sorted({n.split(".self_attn.")[0] + ".self_attn" for n in tensors if ".self_attn." in n})


def _calibration(tensors, inputs: dict | None = None) -> Calibration:
    """A distinct amax per module (so a fused group's members differ) and per attention's K/V,
    laid out as qstream/calibration.py's Observer records them (float32 scalars)."""
    if inputs is None:
        inputs = {m: 0.5 + 0.37 * i for i, m in enumerate(_modules(tensors))}
    kv = {}
    for i, attention in enumerate(_attention(tensors)):
        kv[f"{attention}.k"], kv[f"{attention}.v"] = torch.tensor(1.5 + i), torch.tensor(2.25 + i)
    linears = {m: torch.tensor(float(a)) for m, a in inputs.items()}
    return Calibration({LINEAR_INPUTS: linears, KV_CACHE: kv}, SOURCE)


def _config(out) -> dict:
    return json.loads((out / "config.json").read_text())["quantization_config"]


def observed_scale(preset: str, amax: float, dtype: torch.dtype):
    """compressed-tensors' stored input scale for an observed [-amax, amax] in ``dtype``."""
    a = torch.tensor([amax], dtype=torch.float32).to(dtype)
    if preset == "NVFP4":
        return "input_global_scale", generate_gparam(-a, a)
    args = preset_name_to_scheme(preset, ["Linear"]).input_activations
    scale, _ = calculate_qparams(-a, a, args)
    return "input_scale", scale.reshape(1)


@pytest.mark.parametrize("activations", list(PRESETS))
def test_config_is_the_presets_input_activations(tmp_path, activations):
    fmt, preset = PRESETS[activations]
    tensors = llama_tensors()
    src = write_checkpoint(tmp_path / "in", tensors)
    out = tmp_path / "out"
    quantize_checkpoint(src, out, fmt, activations=activations, calibration=_calibration(tensors))
    qconfig = _config(out)
    written = qconfig["config_groups"]["group_0"]["input_activations"]
    expected = preset_name_to_scheme(preset, ["Linear"]).input_activations
    # the observer is llm-compressor's calibration-time choice, not part of what is served
    assert QuantizationArgs.model_validate(written).model_dump(exclude={"observer"}) == (
        expected.model_dump(exclude={"observer"})
    )
    parsed = QuantizationConfig.model_validate(qconfig)  # compressed-tensors reads it whole
    assert parsed.config_groups["group_0"].input_activations.strategy == expected.strategy
    assert qconfig["kv_cache_scheme"] is None


def test_fp8_dynamic_leaves_every_tensor_as_weight_only_writes_it(tmp_path):
    src = write_checkpoint(tmp_path / "in", llama_tensors())
    only = quantize_checkpoint(src, tmp_path / "w8a16", "fp8")
    quantize_checkpoint(src, tmp_path / "w8a8", "fp8", activations="fp8-dynamic")
    a, b = (
        load_file(tmp_path / "w8a16" / "model.safetensors"),
        load_file(tmp_path / "w8a8" / "model.safetensors"),
    )
    assert list(a) == list(b) and all(as_bytes(a[n]) == as_bytes(b[n]) for n in a)
    ca, cb = _config(tmp_path / "w8a16"), _config(tmp_path / "w8a8")
    cb["config_groups"]["group_0"]["input_activations"] = None
    assert ca == cb
    assert "serving" not in only.to_json()  # a weight-only record is as it was
    record = json.loads((tmp_path / "w8a8" / QUANTIZE_RECORD).read_text())
    assert record["summary"]["serving"] == {"activations": "fp8-dynamic"}
    assert record["command"].endswith(" --activations fp8-dynamic")


@pytest.mark.parametrize("activations", ["fp8-static", "nvfp4"])
def test_static_input_scales_are_compressed_tensors_bit_for_bit(tmp_path, activations):
    fmt, preset = PRESETS[activations]
    tensors = llama_tensors()
    calibration = _calibration(tensors)
    src = write_checkpoint(tmp_path / "in", tensors)
    summary = quantize_checkpoint(
        src, tmp_path / "out", fmt, activations=activations, calibration=calibration
    )
    written = load_file(tmp_path / "out" / "model.safetensors")
    # a fused layer keeps one input scale (vLLM's max over its shards): the group's largest amax
    group_of = {m: g.members for g in fused_groups(summary.modules_quantized) for m in g.members}
    assert len(set(group_of)) >= 5  # q/k/v and gate/up per layer: members differ in amax
    for module in summary.modules_quantized:
        amax = max(float(calibration.input_amax(m)) for m in group_of.get(module, (module,)))
        name, expected = observed_scale(preset, amax, tensors[f"{module}.weight"].dtype)
        stored = written[f"{module}.{name}"]
        assert stored.dtype == expected.dtype and as_bytes(stored) == as_bytes(expected), module
    assert summary.serving == {"activations": activations, "calibration": SOURCE}
    assert verify_checkpoint(tmp_path / "out").ok


AMAXES = [2.0**-20, 1e-3, 0.3, 1.0, 1.7, 447.9, 448.0, 3.0e4, 6.5e4]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activations", ["fp8-static", "nvfp4"])
def test_input_scale_formula_matches_compressed_tensors(activations, dtype):
    preset = PRESETS[activations][1]
    gen = torch.Generator().manual_seed(3)
    values = AMAXES + ((torch.rand(200, generator=gen) * 12 - 6).exp()).tolist()
    for amax in values:
        expected = observed_scale(preset, amax, dtype)[1]
        ours = input_scale(ACTIVATIONS[activations], amax, dtype)
        assert ours.dtype == expected.dtype and as_bytes(ours) == as_bytes(expected), amax


def test_kv_cache_scales_are_compressed_tensors_bit_for_bit(tmp_path):
    tensors = llama_tensors()
    calibration = _calibration(tensors)
    src = write_checkpoint(tmp_path / "in", tensors)
    quantize_checkpoint(
        src, tmp_path / "out", "fp8", kv_cache_scheme="fp8", calibration=calibration
    )
    qconfig = _config(tmp_path / "out")
    assert QuantizationArgs.model_validate(qconfig["kv_cache_scheme"]) == KV_ARGS
    written = load_file(tmp_path / "out" / "model.safetensors")
    attention = _attention(tensors)
    for layer in attention:
        for leaf, amax in zip(("k_scale", "v_scale"), calibration.kv_amax(layer)):
            a = amax.reshape(1).to(torch.bfloat16)
            expected = calculate_qparams(-a, a, KV_ARGS)[0]
            assert as_bytes(written[f"{layer}.{leaf}"]) == as_bytes(expected), layer
    assert len([n for n in written if n.endswith(("k_scale", "v_scale"))]) == 2 * len(attention)
    assert verify_checkpoint(tmp_path / "out").ok


def _quantize_args(src, out, *extra) -> list[str]:
    return ["quantize", "--model_dir", str(src), "--output_dir", str(out), *extra]


REFUSED = {
    "fp8-dynamic with nvfp4": (
        ["--quant_format", "nvfp4", "--activations", "fp8-dynamic"],
        "--activations fp8-dynamic: served with fp8 weights",
    ),
    "nvfp4 with fp8": (
        ["--quant_format", "fp8", "--activations", "nvfp4"],
        "--activations nvfp4: served with nvfp4 weights",
    ),
    "fp8-static": (
        ["--quant_format", "fp8", "--activations", "fp8-static"],
        "--activations fp8-static: needs calibrated scales: pass --calibration",
    ),
    "nvfp4 W4A4": (
        ["--quant_format", "nvfp4", "--activations", "nvfp4"],
        "--activations nvfp4: needs calibrated scales: pass --calibration",
    ),
    "kv cache": (
        ["--quant_format", "fp8", "--kv-cache-scheme", "fp8"],
        "--kv-cache-scheme fp8: needs calibrated scales: pass --calibration",
    ),
    "a calibration no scheme uses": (
        ["--quant_format", "fp8", "--calibration", "gauss"],
        "--calibration: only a static scheme stores calibrated scales",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_scheme_that_cannot_be_written_is_refused_cleanly(tmp_path, case):
    extra, message = REFUSED[case]
    src = write_checkpoint(tmp_path / "in", llama_tensors())
    before = tree_digest(src)
    assert message in cli_error(_quantize_args(src, tmp_path / "out", *extra))
    assert tree_digest(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_k3_kv_cache_scales_are_refused_naming_vllm(tmp_path):
    tensors = dspark_tensors()
    src = write_checkpoint(tmp_path / "in", tensors, dspark_config())
    error = cli_error(
        _quantize_args(src, tmp_path / "out", "--quant_format", "fp8", "--kv-cache-scheme", "fp8")
    )
    assert "K3 DSpark draft" in error and "scale 1.0" in error and "docs/vllm.md" in error
    with pytest.raises(Exception, match="refuses a stored k_scale"):  # even with calibration
        quantize_checkpoint(
            src, tmp_path / "out", "fp8", kv_cache_scheme="fp8", calibration=_calibration(tensors)
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda c: c["inputs"].pop("model.layers.1.mlp.down_proj"),
            "calibration: no input of model.layers.1.mlp.down_proj was observed",
        ),
        (
            lambda c: c["inputs"].__setitem__("model.layers.0.mlp.up_proj", float("nan")),
            "model.layers.0.mlp.up_proj: calibrated input amax nan must be finite",
        ),
        (
            lambda c: c["inputs"].__setitem__("model.layers.0.mlp.up_proj", 0.0),
            "must be finite and > 0",
        ),
    ],
)
def test_a_bad_calibration_is_refused_naming_the_module(tmp_path, change, message):
    tensors = llama_tensors()
    fields = {"inputs": {m: 0.5 + 0.37 * i for i, m in enumerate(_modules(tensors))}}
    change(fields)
    src = write_checkpoint(tmp_path / "in", tensors)
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        quantize_checkpoint(
            src,
            tmp_path / "out",
            "fp8",
            activations="fp8-static",
            calibration=_calibration(tensors, fields["inputs"]),
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def _rewrite(out, change) -> None:
    path = out / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    (out / QUANTIZE_RECORD).unlink(missing_ok=True)  # bytes changed on purpose: no sha256


def test_verify_names_a_module_without_its_input_scale(tmp_path):
    tensors = llama_tensors()
    src = write_checkpoint(tmp_path / "in", tensors)
    out = tmp_path / "out"
    quantize_checkpoint(
        src, out, "fp8", activations="fp8-static", calibration=_calibration(tensors)
    )
    _rewrite(out, lambda t: t.pop("model.layers.1.self_attn.o_proj.input_scale"))
    report = verify_checkpoint(out)
    assert report.problems == [
        "model.layers.1.self_attn.o_proj: input_scale missing (fp8-static activations need one "
        "per quantized module; vLLM 0.32.0 would load the layer silently wrong)"
    ]


def test_verify_needs_the_calibration_in_the_record(tmp_path):
    tensors = llama_tensors()
    src = write_checkpoint(tmp_path / "in", tensors)
    out = tmp_path / "out"
    quantize_checkpoint(src, out, "nvfp4", activations="nvfp4", calibration=_calibration(tensors))
    assert verify_checkpoint(out).ok
    record = json.loads((out / QUANTIZE_RECORD).read_text())
    del record["summary"]["serving"]["calibration"]
    (out / QUANTIZE_RECORD).write_text(json.dumps(record))
    problems = verify_checkpoint(out).problems
    assert any(
        p.startswith(f"{QUANTIZE_RECORD}: no calibration (source and size)") for p in problems
    ), problems


def test_verify_kv_cache_scales(tmp_path):
    tensors = llama_tensors()
    src = write_checkpoint(tmp_path / "in", tensors)
    out = tmp_path / "out"
    quantize_checkpoint(src, out, "fp8", kv_cache_scheme="fp8", calibration=_calibration(tensors))
    _rewrite(out, lambda t: t.pop("model.layers.0.self_attn.v_scale"))
    problems = verify_checkpoint(out).problems
    assert problems and problems[0].startswith("model.layers.0.self_attn.v_scale: missing"), (
        problems
    )


def test_verify_warns_that_the_k3_draft_serves_scale_one(tmp_path):
    src = write_checkpoint(tmp_path / "in", dspark_tensors(), dspark_config())
    out = tmp_path / "out"
    quantize_checkpoint(src, out, "fp8")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = KV_ARGS.model_dump(exclude_none=True)
    (out / "config.json").write_text(json.dumps(config))
    (out / QUANTIZE_RECORD).unlink()
    report = verify_checkpoint(out)
    assert report.ok, report.problems
    assert any("scale 1.0 is what will be served" in w for w in report.warnings), report.warnings
    _rewrite(
        out,
        lambda t: t.__setitem__(
            "layers.0.self_attn.k_scale", torch.tensor([0.5], dtype=torch.bfloat16)
        ),
    )
    assert any(
        p.startswith("layers.0.self_attn.k_scale: vLLM 0.32.0's K3 DSpark draft")
        for p in verify_checkpoint(out).problems
    )


def test_verify_warns_when_no_record_names_the_calibration(tmp_path):
    tensors = llama_tensors()
    src = write_checkpoint(tmp_path / "in", tensors)
    out = tmp_path / "out"
    quantize_checkpoint(
        src, out, "fp8", activations="fp8-static", calibration=_calibration(tensors)
    )
    (out / QUANTIZE_RECORD).unlink()
    report = verify_checkpoint(out)
    assert report.ok, report.problems
    assert any(w.startswith(f"no {QUANTIZE_RECORD}: nothing records the calibration") for w in
               report.warnings), report.warnings  # fmt: skip
