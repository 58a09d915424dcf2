"""Tensors checked against config.json (docs/quantize.md, "Tensors checked against the
config"): ``quantize`` refuses, before writing anything, a draft whose tensors differ from what
its config implies, and ``verify`` reports the same on a quantized checkpoint.

Two serving profiles: the K3 DSpark draft (the synth tiny preset, whose every projection, norm
and head has a shape vLLM builds from config.json) and ``generic`` (a Llama-style checkpoint,
whose fused groups must be complete and agree).  Zero-size weights are refused in every format,
and ``inspect`` flags a weight holding NaN or Inf rather than summarising it."""

import json
import shutil

import pytest
import torch
from checkpoints import llama_tensors, tree_digest, write_checkpoint
from cli_helpers import cli_error
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from qstream.cli import cli
from qstream.formats import FORMATS, quantize
from qstream.quant import quantize_checkpoint

BF16 = torch.bfloat16
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "torch_dtype": "bfloat16",
}


def _replace(name, make):
    def edit(tensors):
        tensors[name] = make(tensors[name])

    return edit


def _drop(name):
    def edit(tensors):
        del tensors[name]

    return edit


def _set_config(key, value):
    def edit(config):
        config[key] = value

    return edit


def _narrow(w):
    return w[:, :63].contiguous()


def _zero_k(w):
    return torch.zeros(w.shape[0], 0, dtype=w.dtype)


def _zero_n(w):
    return torch.zeros(0, w.shape[1], dtype=w.dtype)


# case -> (the tensor edit for a profile's layer prefix, the config edit, what the one Error:
# line must name); the prefix is "" for the DSpark draft's names, "model." for Llama's
CASES = {
    "half a fused pair": (
        lambda p: _drop(f"{p}layers.0.mlp.up_proj.weight"),
        None,
        ["{p}layers.0.mlp.up_proj.weight"],
    ),
    "up_proj [96, 63]": (
        lambda p: _replace(f"{p}layers.0.mlp.up_proj.weight", _narrow),
        None,
        ["{p}layers.0.mlp.up_proj.weight", "[96, 63]", "[96, 64]"],
    ),
    "hidden_size a word": (
        None,
        _set_config("hidden_size", "sixty-four"),
        ["config.json", "hidden_size", "'sixty-four'"],
    ),
    "zero-size [N, 0]": (
        lambda p: _replace(f"{p}layers.0.self_attn.o_proj.weight", _zero_k),
        None,
        ["{p}layers.0.self_attn.o_proj.weight", "[64, 0]"],
    ),
    "zero-size [0, K]": (
        lambda p: _replace(f"{p}layers.0.mlp.down_proj.weight", _zero_n),
        None,
        ["{p}layers.0.mlp.down_proj.weight", "[0, 96]"],
    ),
}
PROFILES = {"dspark": "", "generic": "model."}


def _edit_checkpoint(directory, edit_tensors=None, edit_config=None):
    if edit_tensors is not None:
        (shard,) = directory.glob("*.safetensors")
        tensors = load_file(shard)
        edit_tensors(tensors)
        save_file(tensors, shard, metadata={"format": "pt"})
    if edit_config is not None:
        path = directory / "config.json"
        config = json.loads(path.read_text())
        edit_config(config)
        path.write_text(json.dumps(config))


def _source(profile, tiny, directory):
    if profile == "dspark":
        return shutil.copytree(tiny, directory)
    return write_checkpoint(directory, llama_tensors(), config=dict(LLAMA_CONFIG))


def _quantize_error(src, out, fmt="fp8", *extra):
    return cli_error(
        ["quantize", "--model-dir", str(src), "--output-dir", str(out), "--quant-format", fmt,
         *extra]
    )  # fmt: skip


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("profile", list(PROFILES))
def test_quantize_refuses_tensors_the_config_does_not_imply(tiny, tmp_path, profile, case, fmt):
    edit_tensors, edit_config, names = CASES[case]
    prefix = PROFILES[profile]
    src = _source(profile, tiny, tmp_path / "in")
    _edit_checkpoint(src, edit_tensors and edit_tensors(prefix), edit_config)
    before = tree_digest(src)
    error = _quantize_error(src, tmp_path / "out", fmt)
    for name in names:
        assert name.format(p=prefix) in error, error
    assert tree_digest(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no output, no temporary


def test_k_without_v_is_refused(tmp_path):
    src = write_checkpoint(tmp_path / "in", llama_tensors(), config=dict(LLAMA_CONFIG))
    _edit_checkpoint(src, _drop("model.layers.0.self_attn.v_proj.weight"))
    error = _quantize_error(src, tmp_path / "o", "fp8", "--dry-run")
    assert "model.layers.0.self_attn.v_proj.weight" in error, error


def test_k_proj_of_another_input_width_is_refused(tmp_path):
    src = write_checkpoint(tmp_path / "in", llama_tensors(), config=dict(LLAMA_CONFIG))
    _edit_checkpoint(src, _replace("model.layers.0.self_attn.k_proj.weight", _narrow))
    error = _quantize_error(src, tmp_path / "o")
    assert "model.layers.0.self_attn.k_proj.weight" in error and "[32, 63]" in error, error


@pytest.mark.parametrize("value", [64.0, True, None, -64])
def test_an_integer_field_that_is_not_one_is_refused(tmp_path, value):
    config = {**LLAMA_CONFIG, "num_key_value_heads": value}
    src = write_checkpoint(tmp_path / "in", llama_tensors(), config=config)
    if value is None:  # null: the field is unset (transformers' default applies)
        quantize_checkpoint(src, tmp_path / "o", "fp8", dry_run=True)
        return
    error = _quantize_error(src, tmp_path / "o")
    assert "config.json" in error and f"num_key_value_heads = {value!r}" in error, error


# Layouts vLLM serves with parts of the generic fused groups absent: an MLP without a gate
# (Nemotron, Phi-3-small: up_proj + down_proj), MLA attention (DeepSeek-V2-Lite: q_proj alone,
# kv_a_proj_with_mqa without q_a_proj) and Qwen's w1/w2 MLP (no w3).
def _ungated_mla_qwen():
    gen = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(BF16)

    return {
        "model.layers.0.mlp.up_proj.weight": w(96, 64),
        "model.layers.0.mlp.down_proj.weight": w(64, 96),
        "model.layers.0.self_attn.q_proj.weight": w(96, 64),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": w(40, 64),
        "model.layers.0.self_attn.kv_b_proj.weight": w(128, 32),
        "model.layers.0.self_attn.o_proj.weight": w(64, 64),
        "transformer.h.0.mlp.w1.weight": w(96, 64),
        "transformer.h.0.mlp.w2.weight": w(96, 64),
        "transformer.h.0.mlp.c_proj.weight": w(64, 96),
    }


def test_layouts_with_unfused_members_still_quantize(tmp_path):
    src = write_checkpoint(tmp_path / "in", _ungated_mla_qwen(), config=dict(LLAMA_CONFIG))
    summary = quantize_checkpoint(src, tmp_path / "out", "fp8")
    assert len(summary.modules_quantized) == 9


def test_a_draft_without_embed_tokens_still_quantizes(tiny, tmp_path):
    """vLLM drops the draft's embed_tokens and shares the target's (docs/vllm.md)."""
    src = shutil.copytree(tiny, tmp_path / "in")
    _edit_checkpoint(src, _drop("embed_tokens.weight"))
    plan = quantize_checkpoint(src, tmp_path / "out", "nvfp4", dry_run=True)
    assert plan.modules_quantized


def test_a_draft_without_a_norm_is_refused(tiny, tmp_path):
    src = shutil.copytree(tiny, tmp_path / "in")
    _edit_checkpoint(src, _drop("layers.4.self_attn.kv_a_layernorm.weight"))
    error = _quantize_error(src, tmp_path / "o")
    assert "layers.4.self_attn.kv_a_layernorm.weight" in error and "[32]" in error, error


# --- verify: the same checks on a quantized checkpoint -------------------------------------------


@pytest.fixture(scope="module")
def fp8_outputs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    llama = write_checkpoint(root / "llama", llama_tensors(), config=dict(LLAMA_CONFIG))
    return {
        "dspark": quantize_checkpoint(tiny, root / "dspark-fp8", "fp8").output_dir,
        "generic": quantize_checkpoint(llama, root / "llama-fp8", "fp8").output_dir,
    }


def _drop_module(module):
    def edit(tensors):
        for name in [n for n in tensors if n.startswith(module + ".")]:
            del tensors[name]

    return edit


def _narrow_fp8(module):
    def edit(tensors):
        w = torch.randn(96, 63, generator=torch.Generator().manual_seed(1)).to(BF16) * 0.02
        for suffix, value in quantize("fp8", w).items():
            tensors[f"{module}.{suffix}"] = value

    return edit


def _empty(name):
    def edit(tensors):
        tensors[name] = torch.zeros(0, tensors[name].shape[1], dtype=tensors[name].dtype)

    return edit


VERIFY_CASES = {
    "half a fused pair": (
        lambda p: _drop_module(f"{p}layers.0.mlp.up_proj"),
        None,
        "{p}layers.0.mlp.up_proj.weight",
    ),
    "up_proj [96, 63]": (
        lambda p: _narrow_fp8(f"{p}layers.0.mlp.up_proj"),
        None,
        "{p}layers.0.mlp.up_proj.weight",
    ),
    "hidden_size a word": (None, _set_config("hidden_size", "sixty-four"), "hidden_size"),
    "zero-size unquantized weight": (
        lambda p: _empty("markov_head.markov_w1.weight" if p == "" else "lm_head.weight"),
        None,
        "[0, ",
    ),
}


@pytest.mark.parametrize("case", list(VERIFY_CASES))
@pytest.mark.parametrize("profile", list(PROFILES))
def test_verify_reports_tensors_the_config_does_not_imply(fp8_outputs, tmp_path, profile, case):
    edit_tensors, edit_config, named = VERIFY_CASES[case]
    prefix = PROFILES[profile]
    out = shutil.copytree(fp8_outputs[profile], tmp_path / "copy")
    # another tool's edit: quantize's record of file digests no longer applies
    (out / "qstream_quantize.json").unlink()
    _edit_checkpoint(out, edit_tensors and edit_tensors(prefix), edit_config)
    result = CliRunner().invoke(cli, ["verify", str(out), "--json", "-"])
    assert result.exit_code == 1, result.output
    problems = json.loads(result.stdout)["problems"]
    assert any(named.format(p=prefix) in line for line in problems), problems


@pytest.mark.parametrize("profile", list(PROFILES))
def test_verify_passes_a_good_checkpoint_with_its_checks(fp8_outputs, profile):
    result = CliRunner().invoke(cli, ["verify", str(fp8_outputs[profile])])
    assert result.exit_code == 0, result.output


# --- the format functions -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", [(64, 0), (0, 64)])
def test_format_quantize_refuses_a_zero_size_weight(fmt, shape):
    with pytest.raises(ValueError, match=rf"layers\.0\.o_proj\.weight: shape \[{shape[0]}, "):
        quantize(fmt, torch.zeros(shape, dtype=BF16), name="layers.0.o_proj.weight")


# --- inspect --------------------------------------------------------------------------------------


def test_inspect_flags_a_weight_holding_nan_or_inf(tmp_path):
    tensors = llama_tensors()
    bad = "model.layers.1.mlp.down_proj.weight"
    tensors[bad][3, 5] = float("nan")
    tensors[bad][7, 1] = float("inf")
    src = write_checkpoint(tmp_path / "in", tensors, config=dict(LLAMA_CONFIG))
    result = CliRunner().invoke(cli, ["inspect", str(src), "--json", "-"])
    # a report of what is there: exit 0, with a warning naming the tensor on stderr
    assert result.exit_code == 0, result.output
    warning = [line for line in result.stderr.splitlines() if line.startswith("Warning: ")]
    assert len(warning) == 1 and bad in warning[0] and "2 NaN/Inf" in warning[0], result.stderr
    rows = {r["name"]: r for r in json.loads(result.stdout)["weight_stats"]}
    assert rows[bad]["non_finite"] == 2
    # no ordinary-looking statistics for it
    assert all(rows[bad][k] is None for k in ("std", "kurtosis", "max_over_std")), rows[bad]
    assert rows["model.layers.0.mlp.down_proj.weight"]["non_finite"] == 0
    table = CliRunner().invoke(cli, ["inspect", str(src)])
    assert table.exit_code == 0 and "non-finite" in table.stdout, table.output
