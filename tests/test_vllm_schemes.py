"""quantize's activation and KV-cache schemes through vLLM 0.32.0's own DSpark loaders, on CPU
(the vLLM lane; docs/vllm.md, "Activation schemes" and "KV-cache scales").  Both drafts: the
K3 draft (the tiny synth) and the Qwen3-style one.  Each written scheme must load with the
scheme vLLM names for it, every stored tensor consumed and every parameter the stored bytes;
what vLLM does with a missing input scale and with KV-cache scales is pinned, so that a change
in vLLM shows up here.  The static scales come from a real calibration run (quantize
--calibration gauss's CalibrationSet); the KV amaxes are set by hand on top of it."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import DSPARK_RECIPE
from safetensors.torch import load_file, save_file
from test_vllm_loader import vllm_did  # what vLLM did: raised, warned, or loaded silently

from qstream.calibration import KV_CACHE, Calibration, CalibrationSet
from qstream.checkpoint.files import open_checkpoint
from qstream.publish import QUANTIZE_RECORD
from qstream.quant import quantize_checkpoint
from qstream.synth.draft import synth_checkpoint
from qstream.vllm.loader import load_with_vllm
from qstream.vllm.verify import verify_checkpoint

pytestmark = pytest.mark.vllm

# activations -> weight format
WRITTEN = {"fp8-dynamic": "fp8", "fp8-static": "fp8", "nvfp4": "nvfp4"}
# activations -> the scheme vLLM 0.32.0 builds for every quantized module (the loader's label:
# "(static)" for a static input scale, "(use_a16)" for weight-only NVFP4, neither wanted here)
BUILT = {
    "fp8-dynamic": "CompressedTensorsW8A8Fp8",
    "fp8-static": "CompressedTensorsW8A8Fp8(static)",
    "nvfp4": "CompressedTensorsW4A4Fp4",
}


def calibration(draft: Path) -> Calibration:
    """quantize --calibration gauss's run, with a distinct non-1.0 K and V amax per attention
    layer added by hand."""
    measured = CalibrationSet("gauss", blocks=8).run(draft)
    names = list(open_checkpoint(draft).tensor_shard)
    attention = sorted(
        {n.split(".self_attn.")[0] + ".self_attn" for n in names if ".self_attn." in n}
    )
    kv = {}
    for i, a in enumerate(attention):
        kv[f"{a}.k"], kv[f"{a}.v"] = torch.tensor(2.0 + i), torch.tensor(3.0 + i)
    return Calibration({**measured.amax, KV_CACHE: kv}, measured.source)


@pytest.fixture(scope="module")
def drafts(tiny, tmp_path_factory):
    """The K3 tiny synth and the qwen3-tiny synth (each with the tokenizer and stand-in target
    head that calibration drafts with)."""
    qwen3 = tmp_path_factory.mktemp("qwen3") / "d"
    synth_checkpoint("qwen3-tiny", qwen3, seed=0)
    return {"k3": Path(tiny), "qwen3": qwen3}


@pytest.fixture(scope="module")
def outputs(drafts, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-schemes")
    out = {}
    for arch, draft in drafts.items():
        include = DSPARK_RECIPE if arch == "k3" else None
        calibrated = calibration(draft)
        for activations, fmt in WRITTEN.items():
            dest = root / f"{arch}-{activations}"
            quantize_checkpoint(
                draft, dest, fmt, include=include, activations=activations,
                calibration=calibrated,
            )  # fmt: skip
            out[arch, activations] = dest
    return out


@pytest.mark.parametrize("activations", list(WRITTEN))
@pytest.mark.parametrize("arch", ["k3", "qwen3"])
def test_vllm_builds_the_activation_scheme(outputs, arch, activations):
    out = outputs[arch, activations]
    assert verify_checkpoint(out).ok
    report = load_with_vllm(out)
    assert report.raised is None and report.problems == [], report.problems
    schemes = {m["scheme"] for m in report.modules}
    # every quantized module W8A8 (static with fp8-static) / W4A4 (without use_a16), the rest
    # unquantized; every stored tensor consumed (report.problems names one left over)
    assert schemes == {BUILT[activations], "unquantized"}, schemes


@pytest.mark.parametrize(
    ("arch", "activations", "stored"),
    [("k3", "fp8-static", "input_scale"), ("qwen3", "nvfp4", "input_global_scale")],
)
def test_a_missing_input_scale_is_refused_and_vllm_loads_it_silently(
    outputs, tmp_path, arch, activations, stored
):
    out = tmp_path / "missing"
    shutil.copytree(outputs[arch, activations], out)
    tensors = load_file(out / "model.safetensors")
    victim = sorted(n for n in tensors if n.endswith(f".{stored}"))[0]
    del tensors[victim]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / QUANTIZE_RECORD).unlink()
    module = victim.removesuffix(f".{stored}")
    assert any(p.startswith(f"{module}: {stored} missing") for p in verify_checkpoint(out).problems)
    loaded = load_with_vllm(out)
    # vLLM 0.32.0 neither raises nor warns: the parameter keeps create_weights' value
    # (float32's lowest for FP8's input_scale, torch.empty for NVFP4's input_global_scale)
    assert vllm_did(loaded) == "loaded silently", (loaded.raised, loaded.warnings)
    assert any(
        p.endswith(f".{stored}: left unloaded by vLLM (no stored tensor reached it)")
        for p in loaded.problems
    ), loaded.problems


def test_the_qwen3_draft_serves_the_checkpoints_kv_scales(drafts, tmp_path):
    given = calibration(drafts["qwen3"])
    out = tmp_path / "kv"
    quantize_checkpoint(drafts["qwen3"], out, "fp8", kv_cache_scheme="fp8", calibration=given)
    assert verify_checkpoint(out).ok
    report = load_with_vllm(out)
    assert report.problems == [], report.problems
    stored = load_file(out / "model.safetensors")
    held = {layer["module"]: layer for layer in report.kv_cache}
    attention_layers = [k.removesuffix(".k") for k in given.amax[KV_CACHE] if k.endswith(".k")]
    assert len(held) == len(attention_layers)
    for attention in attention_layers:
        layer = held[f"model.{attention}.attn"]
        # kv_cache_scheme turns vLLM's "auto" cache into fp8 (attention.py, Attention.__init__)
        assert layer["dtype"] == "fp8"
        assert layer["k_scale"] == stored[f"{attention}.k_scale"].item() != 1.0
        assert layer["v_scale"] == stored[f"{attention}.v_scale"].item() != 1.0


def test_the_qwen3_draft_refuses_kv_scales_with_an_e5m2_cache(drafts, tmp_path):
    """eval-drift refuses a KV scale with kv=fp8_e5m2 (qstream/serving.py, E5M2_UNSCALED)
    because vLLM does: ``_init_kv_cache_quant`` (attention.py) raises for a checkpoint that
    declares a kv_cache_scheme; the same checkpoint loads with an e4m3 cache."""
    out = tmp_path / "kv"
    quantize_checkpoint(drafts["qwen3"], out, "fp8", kv_cache_scheme="fp8",
                        calibration=calibration(drafts["qwen3"]))  # fmt: skip
    loaded = load_with_vllm(out, kv_cache_dtype="fp8_e5m2")
    assert vllm_did(loaded) == "raised"
    assert "fp8_e5m2 kv-cache is not supported with fp8 checkpoints" in loaded.raised
    loaded = load_with_vllm(out, kv_cache_dtype="fp8_e4m3")
    assert loaded.problems == [] and {layer["dtype"] for layer in loaded.kv_cache} == {"fp8_e4m3"}


def _with_kv_scheme(src: Path, dest: Path, scales: bool) -> Path:
    """``src`` declaring an FP8 KV cache, with non-1.0 k_scale/v_scale per layer if ``scales``
    (what another tool might write for the K3 draft; qstream refuses to)."""
    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = dict(
        num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False
    )
    (dest / "config.json").write_text(json.dumps(config))
    (dest / QUANTIZE_RECORD).unlink()
    if scales:
        tensors = load_file(dest / "model.safetensors")
        layers = sorted({n.split(".self_attn.")[0] for n in tensors if ".self_attn." in n})
        for i, layer in enumerate(layers):
            for leaf, value in (("k_scale", 0.5 + i), ("v_scale", 0.25 + i)):
                tensors[f"{layer}.self_attn.{leaf}"] = (
                    tensors[f"{layer}.self_attn.o_proj.weight_scale"][:1, 0] * 0 + value
                )
        save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_the_k3_draft_refuses_kv_scales_and_serves_one(outputs, tmp_path):
    """vLLM 0.32.0's K3 MultiHeadLatentAttention is no ``Attention``: compressed-tensors gives it
    no KV-cache method, so no k_scale parameter (its checkpoint's k_scale is remapped to
    ``self_attn.attn.k_scale`` and refused), and kv_cache_scheme leaves the cache "auto"."""
    src = outputs["k3", "fp8-dynamic"]
    scaled = _with_kv_scheme(src, tmp_path / "scaled", scales=True)
    assert any(
        p.startswith("layers.0.self_attn.k_scale: vLLM 0.32.0's K3 DSpark draft")
        for p in verify_checkpoint(scaled).problems
    )
    loaded = load_with_vllm(scaled)
    assert vllm_did(loaded) == "raised"
    assert "There is no module or parameter named 'model.layers.0.self_attn.attn'" in loaded.raised
    plain = _with_kv_scheme(src, tmp_path / "plain", scales=False)
    report = verify_checkpoint(plain)
    assert report.ok and any("scale 1.0 is what will be served" in w for w in report.warnings)
    loaded = load_with_vllm(plain)
    assert loaded.problems == [], loaded.problems
    assert loaded.kv_cache and all(
        (layer["dtype"], layer["k_scale"], layer["v_scale"]) == ("auto", 1.0, 1.0)
        for layer in loaded.kv_cache
    ), loaded.kv_cache
