"""The Qwen3-style DSpark draft's serving profile (docs/vllm.md, "The Qwen3-style DSpark draft"),
checked without vLLM: runtime names, fused groups, the heads vLLM never quantizes, markov_w2
(a ParallelLMHead) quantized only with a target naming it, quantize's default selection, the
ignore list as vLLM's matcher reads it, and the tensor-parallel head rule.  The vLLM lane
(tests/test_vllm_qwen3_dspark.py) loads the same checkpoints with vLLM itself."""

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from qwen3_drafts import REDUCED, TINY, write_qwen3_draft
from safetensors.torch import load_file, save_file

from qstream.arch.dspark_qwen3 import DEFAULT_INCLUDE
from qstream.cli import cli
from qstream.errors import QStreamError
from qstream.formats import quantize
from qstream.quant import quantize_checkpoint
from qstream.vllm.profiles import fused_groups, profile_for, runtime_modules, tp_build_problem
from qstream.vllm.verify import verify_checkpoint

LAYERS = 5
W2 = "markov_head.markov_w2"


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return write_qwen3_draft(tmp_path_factory.mktemp("qwen3") / "draft")


def vllm_ignores(name: str, ignore: list[str]) -> bool:
    """compressed-tensors in vLLM 0.32.0 (should_ignore_layer, no packed mapping for a draft's
    own quant config): equal, or ``re:`` + re.match."""
    return any(e == name or (e.startswith("re:") and re.match(e[3:], name)) for e in ignore)


def qconfig(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["quantization_config"]


def test_runtime_modules_are_vllms_names_at_every_L():
    profile = profile_for(TINY.to_json())
    assert profile.name == "Qwen3DSparkModel"
    modules = [m.rsplit(".", 1)[0] for m in _shapes() if m.endswith(".weight")]
    for L in (8, 36):
        built = {rt.name: rt for rt in runtime_modules(profile, modules, L)}
        qkv = built[f"model.layers.{L + 2}.self_attn.qkv_proj"]
        assert qkv.shards == tuple(f"layers.2.self_attn.{p}_proj" for p in "qkv")
        assert built[f"model.layers.{L}.mlp.gate_up_proj"].shards == (
            "layers.0.mlp.gate_proj",
            "layers.0.mlp.up_proj",
        )
        assert built["model.fc"].shards == ("fc",) and built["model.fc"].linear
        assert not built[f"model.{W2}"].linear  # a ParallelLMHead: "Linear" misses it
        assert len(built) == 4 * LAYERS + 2  # no confidence head, lm_head, embeddings


def _shapes():
    from qstream.arch.dspark_qwen3 import tensor_shapes

    return tensor_shapes(TINY)


def test_fused_groups_are_per_layer_qkv_and_gate_up():
    profile = profile_for(TINY.to_json())
    modules = [m.rsplit(".", 1)[0] for m in _shapes() if m.endswith(".weight")]
    labels = [g.label for g in fused_groups(modules, profile)]
    assert labels == [
        label
        for i in range(LAYERS)
        for label in (
            f"layers.{i}.self_attn.{{q_proj, k_proj, v_proj}}",
            f"layers.{i}.mlp.{{gate_proj, up_proj}}",
        )
    ]


def test_default_selection_is_the_descriptors_include(draft, tmp_path):
    out = quantize_checkpoint(draft, tmp_path / "out", "nvfp4").output_dir
    written = load_file(Path(out) / "model.safetensors")
    quantized = {n.rsplit(".", 1)[0] for n in written if n.endswith(".weight_packed")}
    kinds = {q.split(".", 2)[-1] if q.startswith("layers.") else q for q in quantized}
    assert kinds == set(DEFAULT_INCLUDE)
    ignore = qconfig(Path(out))["ignore"]
    for name in (f"model.{W2}", "model.markov_head.markov_w1", "model.confidence_head.proj"):
        assert vllm_ignores(name, ignore), name
    for L in (8, 36):
        assert not vllm_ignores(f"model.layers.{L}.self_attn.qkv_proj", ignore)
    assert verify_checkpoint(out).problems == []


def test_ignored_qkv_matches_the_fused_runtime_name_at_any_L(draft, tmp_path):
    ignore = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    out = quantize_checkpoint(draft, tmp_path / "out", "fp8", ignore=ignore).output_dir
    entries = qconfig(Path(out))["ignore"]
    for L in (0, 8, 36, 93):
        assert vllm_ignores(f"model.layers.{L + 4}.self_attn.qkv_proj", entries)
        assert not vllm_ignores(f"model.layers.{L + 4}.self_attn.o_proj", entries)
    for L in (8, 36):
        assert verify_checkpoint(out, target_layers=L).problems == []


def test_checkpoint_local_ignore_names_are_refused(draft, tmp_path):
    """vLLM never offsets a compressed-tensors ignore list (_add_global_draft_layer_exclusions
    reads only a ModelOpt exclude_modules), so ``layers.0.self_attn.q_proj`` matches nothing."""
    ignore = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    out = Path(quantize_checkpoint(draft, tmp_path / "out", "fp8", ignore=ignore).output_dir)
    config = json.loads((out / "config.json").read_text())
    entries = [e for e in config["quantization_config"]["ignore"] if "q_proj" not in e]
    local = [f"layers.{i}.self_attn.{p}_proj" for i in range(LAYERS) for p in "qkv"]
    config["quantization_config"]["ignore"] = entries + local
    (out / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(cli, ["verify", str(out)])
    assert result.exit_code == 1
    assert "model.layers.8.self_attn.qkv_proj: vLLM builds it fp8" in result.output


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_markov_w2_is_quantized_with_a_target_naming_it(draft, tmp_path, fmt):
    include = [*DEFAULT_INCLUDE, W2]
    out = Path(quantize_checkpoint(draft, tmp_path / "out", fmt, include=include).output_dir)
    targets = qconfig(out)["config_groups"]["group_0"]["targets"]
    assert targets[0] == "Linear" and any(vllm_ignores(f"model.{W2}", [t]) for t in targets[1:])
    assert verify_checkpoint(out).problems == []
    # without the target, vLLM would build it unquantized and refuse the stored codes
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["targets"] = ["Linear"]
    (out / "config.json").write_text(json.dumps(config))
    problems = verify_checkpoint(out).problems
    assert [p for p in problems if p.startswith(f"model.{W2}: vLLM builds it unquantized")]


def test_markov_w2_with_gathered_projection_is_refused(tmp_path):
    config = {**TINY.to_json(), "dspark_draft_topk": 8}
    draft = write_qwen3_draft(tmp_path / "draft")
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(QStreamError, match=r"^markov_head\.markov_w2: .*dspark_draft_topk 8"):
        quantize_checkpoint(draft, tmp_path / "out", "nvfp4", include=[W2])
    assert not (tmp_path / "out").exists()
    out = quantize_checkpoint(draft, tmp_path / "ok", "nvfp4").output_dir  # default: fine
    assert verify_checkpoint(out).problems == []


@pytest.mark.parametrize(
    "module", ["confidence_head.proj", "lm_head", "markov_head.markov_w1", "embed_tokens"]
)
def test_modules_vllm_never_quantizes_are_refused_in_one_line(tmp_path, module):
    draft = write_qwen3_draft(tmp_path / "draft", REDUCED)
    result = CliRunner().invoke(
        cli,
        ["quantize", "--model_dir", str(draft), "--output_dir", str(tmp_path / "o"),
         "--quant_format", "fp8", "--include_layers", module],
    )  # fmt: skip
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and module in lines[0]


def test_d2t_and_t2d_pass_through_unquantized(tmp_path):
    draft = write_qwen3_draft(tmp_path / "draft", REDUCED)
    tensors = load_file(draft / "model.safetensors")
    tensors["t2d"] = torch.arange(REDUCED.vocab_size) % 2 == 0
    save_file(tensors, draft / "model.safetensors", metadata={"format": "pt"})
    out = quantize_checkpoint(draft, tmp_path / "out", "mxfp4").output_dir
    written = load_file(Path(out) / "model.safetensors")
    assert torch.equal(written["d2t"], tensors["d2t"]) and written["d2t"].dtype == torch.int64
    assert torch.equal(written["t2d"], tensors["t2d"]) and written["t2d"].dtype == torch.bool
    assert written["lm_head.weight"].dtype == torch.bfloat16
    assert verify_checkpoint(out).problems == []


def test_differing_qkv_global_scales_are_refused(draft, tmp_path):
    out = Path(quantize_checkpoint(draft, tmp_path / "out", "nvfp4").output_dir)
    base = load_file(draft / "model.safetensors")
    tensors = load_file(out / "model.safetensors")
    for p in "qkv":
        module = f"layers.1.self_attn.{p}_proj"
        tensors.update(
            {f"{module}.{k}": v for k, v in quantize("nvfp4", base[f"{module}.weight"]).items()}
        )
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    problems = verify_checkpoint(out).problems
    assert [p for p in problems if "layers.1.self_attn.{q_proj, k_proj, v_proj}" in p], problems


def test_tp_needs_key_value_heads_that_divide_or_are_divided():
    profile = profile_for(TINY.to_json())
    shapes = {m.rsplit(".", 1)[0]: s for m, s in _shapes().items() if len(s) == 2}
    assert tp_build_problem(profile, TINY.to_json(), shapes, 4) is None  # 2 kv heads, replicated
    three = {**TINY.to_json(), "num_attention_heads": 6, "num_key_value_heads": 3}
    why = tp_build_problem(profile, three, shapes, 2)
    assert why is not None and "num_key_value_heads 3" in why
