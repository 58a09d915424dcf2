"""The EAGLE-3 draft (docs/eagle3.md): `qstream synth --preset eagle3-tiny`, its config in vLLM's
and speculators' layouts, the checkpoint's Error lines, the forward's own consistency (its
parity with speculators 0.9.0 is tests/test_speculators_eagle3.py, in the speculators lane), and
both forms' serving profiles under `quantize` and `verify` (vLLM 0.32.0's own loader on them is
tests/test_vllm_eagle3.py, in the vLLM lane)."""

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import cli_error, cli_ok
from safetensors.torch import load_file, save_file

from qstream.arch.eagle3 import ARCH, PRESETS, Eagle3Config, tensor_shapes
from qstream.arch.interface import EMBED, TARGET_HEAD_DIR
from qstream.arch.registry import architecture_of, load_config
from qstream.errors import QStreamError
from qstream.serving import REFERENCE_VARIANT
from qstream.vllm.profiles import (
    head_problem,
    ignore_entries,
    matches,
    never_quantized,
    profile_for,
    runtime_modules,
)
from qstream.vllm.verify import verify_checkpoint


def test_synth_writes_the_table_and_a_config_vllm_reads(e3):
    config = load_config(e3, evaluated=False)
    assert architecture_of(config) is ARCH and isinstance(config, Eagle3Config)
    data = json.loads((e3 / "config.json").read_text())
    assert data["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert data["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}
    assert Eagle3Config.from_json(data) == config
    tensors = load_file(e3 / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in tensors.items()} == tensor_shapes(config)
    lent = load_file(next((e3 / TARGET_HEAD_DIR).glob("*.safetensors")))
    assert torch.equal(lent[EMBED], tensors[EMBED])  # the draft's embedding is the target's


def test_inspect_reads_it(e3):
    data = json.loads(cli_ok(["inspect", str(e3), "--no-stats", "--json", "-"]).stdout)
    assert "fc.weight" in [k["kind"] for k in data["kinds"]]


# fp32 logits of the same keys summed in another order (more, masked, keys in the softmax and
# matmuls of another shape): they agree to about 1e-6 at these magnitudes (|logit| < 10)
ORDER_TOL = 1e-5


@pytest.fixture(scope="module")
def model(e3):
    config = load_config(e3, evaluated=False)
    weights = ARCH.load_weights(e3, None, config)
    return ARCH.build(config, weights, REFERENCE_VARIANT, "cpu")


def test_prefill_is_causal_and_a_chain_starts_from_it(model):
    g = torch.Generator().manual_seed(0)
    c = model.config
    ids = torch.randint(0, c.vocab_size, (2, 24), generator=g)
    aux = torch.randn(2, 24, c.aux_size, generator=g)
    with torch.no_grad():
        pre = model.prefill(ids, aux)
        head = model.prefill(ids[:, :10], aux[:, :10])
        chain = model.chain(pre, torch.tensor([1, 0]), torch.tensor([9, 23]), 4)
    torch.testing.assert_close(head.logits, pre.logits[:, :10], rtol=0, atol=ORDER_TOL)
    assert torch.equal(chain.logits[:, 0], pre.logits[[1, 0], [9, 23]])
    assert chain.tokens[:, 0].tolist() == pre.logits[[1, 0], [9, 23]].argmax(-1).tolist()
    # step 1 re-read: the prefill up to the anchor, then the drafted token beside the state
    with torch.no_grad():
        again = model.step(
            chain.tokens[:1, :1], chain.hidden[:1, :1], torch.tensor([[10]]),
            (pre.k[1:, :10], pre.v[1:, :10]), torch.ones(1, 1, 10, dtype=torch.bool),
        )  # fmt: skip
    torch.testing.assert_close(again.logits[0, 0], chain.logits[0, 1], rtol=0, atol=ORDER_TOL)


DENSE = PRESETS["eagle3-tiny"].to_json()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"eagle_config": {}, "num_aux_hidden_states": 4}, "num_aux_hidden_states = 4 must be 3"),
        ({"draft_vocab_size": 2048}, "draft_vocab_size = 2048 must not exceed"),
        ({"norm_before_fc": True}, "norm_before_fc = True makes an RMSNorm before fc"),
        ({"num_hidden_layers": 2}, "num_hidden_layers = 2 must be 1"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 2, 6]}}, "must be distinct"),
        (
            {"eagle_config": {}, "eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]},
            r"eagle_aux_hidden_state_layer_ids = \[1, 2, 3, 4\] must list 3 layers",
        ),
    ],
)
def test_a_bad_config_is_one_error_naming_key_and_value(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**DENSE, **change}))
    with pytest.raises(QStreamError, match=message):
        load_config(tmp_path, evaluated=False)


def test_the_speculators_layout_is_read_as_update_eagle3_reads_it(tmp_path):
    layer = {k: DENSE[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
             "num_key_value_heads", "vocab_size", "rms_norm_eps", "max_position_embeddings",
             "rope_parameters")}  # fmt: skip
    data = {"speculators_model_type": "eagle3", "draft_vocab_size": 512,
            "transformer_layer_config": {**layer, "model_type": "qwen3"}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(data))
    config = load_config(tmp_path, evaluated=False)
    assert config.architecture == "Eagle3Qwen3ForCausalLM" and config.qk_norm
    assert config.norm_before_residual is True  # update_eagle3's default when the key is absent
    assert (config.head_dim, config.num_aux_hidden_states, config.aux_layer_ids) == (16, 3, None)
    # four aux layers, as speculators sizes fc: the Qwen3 form counts the ids, the Llama form
    # reads three states (qwen3_eagle3.py's and llama_eagle3.py's __init__)
    data["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5, 7]
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert load_config(tmp_path, evaluated=False).aux_size == 4 * 64
    data["transformer_layer_config"]["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(QStreamError, match=r"\[1, 3, 5, 7\] must list 3 layers"):
        load_config(tmp_path, evaluated=False)
    data["transformer_layer_config"]["model_type"] = "mistral"
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(QStreamError, match="model_type = 'mistral' must be one of llama, qwen3"):
        load_config(tmp_path, evaluated=False)


def _reduced(tmp_path: Path, d2t: torch.Tensor, midlayer: bool = False) -> Path:
    config = Eagle3Config(**{**PRESETS["eagle3-tiny"].__dict__, "draft_vocab_size": 4})
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=g) for k, s in tensor_shapes(config).items()}
    tensors["d2t"] = d2t
    if midlayer:  # EAGLE-3's original name for the decoder layer
        tensors = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config.to_json()))
    return tmp_path


@pytest.mark.parametrize(
    ("d2t", "message"),
    [
        (
            torch.tensor([0, 5, 1030, 7]),
            r"d2t\[2\] = 1030 maps draft id 2 to target id 1032, outside",
        ),
        (torch.tensor([0, 5, 4, 7]), r"d2t\[2\] = 4 maps draft id 2 to target id 6, as d2t\[1\]"),
        (torch.tensor([0.0, 5.0, 9.0, 7.0]), "tensor 'd2t' is float32, expected int64 offsets"),
    ],
)
def test_a_bad_d2t_is_one_error_naming_it(tmp_path, d2t, message):
    directory = _reduced(tmp_path, d2t)
    with pytest.raises(QStreamError, match=message):
        ARCH.load_weights(directory, None, load_config(directory, evaluated=False))


def test_midlayer_names_load_as_layers_0(tmp_path):
    directory = _reduced(tmp_path, torch.tensor([0, 5, 9, 7]), midlayer=True)
    weights = ARCH.load_weights(directory, None, load_config(directory, evaluated=False))
    assert "layers.0.hidden_norm.weight" in weights and weights["d2t"].tolist() == [0, 5, 9, 7]


def test_llama3_rope_scaling_is_read_in_the_legacy_layout_and_round_trips(tmp_path):
    """Llama-3.1 EAGLE-3 drafts carry rope_theta beside rope_scaling (speculators'
    LLAMA3 case checks the frequencies against transformers')."""
    scaling = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}  # fmt: skip
    data = {k: v for k, v in DENSE.items() if k != "rope_parameters"}
    data.update(rope_theta=500000.0, rope_scaling=scaling)
    config = Eagle3Config.from_json(data)
    assert config.rope_parameters.to_json() == {**scaling, "rope_theta": 500000.0}
    assert Eagle3Config.from_json(config.to_json()) == config
    data["rope_scaling"] = {**scaling, "beta": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(QStreamError, match="rope_parameters.beta = 2.0 is not evaluated"):
        load_config(tmp_path, evaluated=False)


# --- the serving profiles (docs/vllm.md, "The EAGLE-3 draft") ------------------------------------


def write_eagle3(directory: Path, config: Eagle3Config, seed: int = 0) -> Path:
    """A bf16 draft of ``config`` with weights drawn from ``seed``; a reduced vocabulary maps
    draft id i to target id i (d2t all zero)."""
    directory.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {
        k: torch.randn(s, generator=g).to(torch.bfloat16)
        for k, s in tensor_shapes(config).items()
        if k != "d2t"
    }
    if config.reduced_vocab:
        tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config.to_json()))
    return directory


# The Qwen3 form with a reduced vocabulary of a size that is no multiple of 64 (vLLM pads the
# lm_head's rows)
QWEN3 = Eagle3Config(**{**PRESETS["eagle3-tiny"].__dict__, "model_type": "qwen3",
                        "vocab_size": 1000, "draft_vocab_size": 500})  # fmt: skip
INCLUDE = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.q_proj", "self_attn.k_proj",
           "self_attn.v_proj", "self_attn.o_proj", "fc"]  # fmt: skip


def test_each_form_is_served_by_its_own_class_with_the_same_rules():
    llama, qwen3 = (profile_for(c.to_json()) for c in (PRESETS["eagle3-tiny"], QWEN3))
    assert (llama.name, llama.served_class) == ("Eagle3LlamaForCausalLM",) * 2
    assert (qwen3.name, qwen3.served_class) == ("Eagle3Qwen3ForCausalLM",) * 2
    assert profile_for({"architectures": ["LlamaForCausalLMEagle3"]}) is llama
    for form, profile in (("llama", llama), ("qwen3", qwen3)):  # update_eagle3's class per form
        saved = {
            "speculators_model_type": "eagle3",
            "transformer_layer_config": {"model_type": form},
        }
        assert profile_for(saved) is profile
    assert (
        profile_for({"speculators_model_type": "eagle3", "transformer_layer_config": {}}) is llama
    )
    assert (llama.method, llama.loader, llama.default_include) == (
        "eagle3",
        "eagle",
        tuple(INCLUDE),
    )
    assert ARCH.quantize_include == tuple(INCLUDE)
    for profile in (llama, qwen3):
        assert never_quantized(profile, "embed_tokens") and not never_quantized(profile, "fc")
        for fmt in ("fp8", "nvfp4", "mxfp4"):  # the ParallelLMHead takes the quant config
            assert head_problem(profile, "lm_head", fmt, {}) is None


def test_the_midlayer_runs_as_layer_L_and_the_qwen3_forms_qkv_proj_sits_under_the_layer():
    modules = [m for m in (k.removesuffix(".weight") for k in tensor_shapes(QWEN3)) if "proj" in m
               or m in ("fc", "lm_head")]  # fmt: skip
    llama, qwen3 = (profile_for(c.to_json()) for c in (PRESETS["eagle3-tiny"], QWEN3))
    names = {
        p.name: {m.name: m.shards for m in runtime_modules(p, modules, 8)} for p in (llama, qwen3)
    }
    qkv = ("layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj")
    assert names[llama.name]["model.layers.8.self_attn.qkv_proj"] == qkv
    assert names[qwen3.name]["model.layers.8.qkv_proj"] == qkv
    for p in (llama, qwen3):
        assert {"model.fc", "lm_head", "model.layers.8.mlp.gate_up_proj"} <= set(names[p.name])
        assert {"model.layers.8.self_attn.o_proj", "model.layers.8.mlp.down_proj"} <= set(
            names[p.name]
        )
    # an ignored q/k/v names the runtime layer vLLM builds, whichever form
    ignored = ignore_entries(qwen3, qkv, modules, 8)
    assert [e for e in ignored if "proj" in e] == [
        r"re:.*\.(self_attn\.q_proj|self_attn\.k_proj|self_attn\.v_proj|qkv_proj)$"
    ]
    assert matches(ignored[0], "model.layers.8.qkv_proj") and matches(ignored[0], qkv[0])
    assert not matches(ignored[0], "model.layers.8.self_attn.o_proj")


# --- quantize and verify -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "activations"), [("fp8", "none"), ("nvfp4", "none"), ("fp8", "fp8-dynamic")]
)
def test_quantize_and_verify_the_synth_draft(e3, tmp_path, fmt, activations):
    out = tmp_path / fmt
    cli_ok(["quantize", "--model_dir", str(e3), "--output_dir", str(out), "--quant_format", fmt,
            "--activations", activations, "--json", str(tmp_path / "q.json")])  # fmt: skip
    summary = json.loads((tmp_path / "q.json").read_text())
    assert summary["serving_profile"] == "Eagle3LlamaForCausalLM"
    assert sorted(summary["modules_quantized"]) == sorted(
        "fc" if k == "fc" else f"layers.0.{k}" for k in INCLUDE
    )
    result = cli_ok(["verify", str(out), "--deep"])
    assert "vLLM rules Eagle3LlamaForCausalLM (served as Eagle3LlamaForCausalLM)" in result.output
    assert "L=8" in result.output  # config.json's target_num_hidden_layers
    cli_ok(["verify", str(out), "--json", str(tmp_path / "v.json")])
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["ok"] and report["problems"] == []
    runtime = {m["module"] for m in report["runtime_modules"]}
    assert {"model.fc", "model.layers.8.self_attn.qkv_proj", "model.layers.8.mlp.gate_up_proj"} <= (
        runtime
    )


def test_the_lm_head_is_quantized_when_asked_with_its_own_target(tmp_path):
    draft = write_eagle3(tmp_path / "q3", QWEN3)
    out = tmp_path / "nvfp4"
    cli_ok(["quantize", "--model_dir", str(draft), "--output_dir", str(out), "--quant_format",
            "nvfp4", "--include_layers", *INCLUDE, "lm_head"])  # fmt: skip
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["config_groups"]["group_0"]["targets"] == ["Linear", "lm_head"]
    assert "vLLM rules Eagle3Qwen3ForCausalLM" in cli_ok(["verify", str(out), "--deep"]).output


def test_a_module_vllm_never_quantizes_asked_for_is_one_error_line(e3, tmp_path):
    out = tmp_path / "out"
    error = cli_error(["quantize", "--model_dir", str(e3), "--output_dir", str(out),
                       "--quant_format", "fp8", "--include_layers", "embed_tokens"])  # fmt: skip
    assert "selects embed_tokens, which vLLM cannot serve quantized" in error
    assert "VocabParallelEmbedding built without a quant config" in error and not out.exists()


QKV = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]


@pytest.mark.parametrize(
    ("form", "ignored", "written", "edited", "runtime"),
    [
        # checkpoint-local: vLLM 0.32.0 remaps no compressed-tensors ignore entry
        ("llama", ["mlp.down_proj"], r"re:.*\.mlp\.down_proj$", "layers.0.mlp.down_proj",
         "model.layers.8.mlp.down_proj"),
        # the Llama form's qkv_proj name, which the Qwen3 form's layer does not have
        ("qwen3", QKV, r"re:.*\.(self_attn\.q_proj|self_attn\.k_proj|self_attn\.v_proj|qkv_proj)$",
         r"re:.*\.self_attn\.(q_proj|k_proj|v_proj|qkv_proj)$", "model.layers.8.qkv_proj"),
    ],
)  # fmt: skip
def test_an_ignore_entry_vllm_does_not_match_is_named_by_verify(
    tmp_path, form, ignored, written, edited, runtime
):
    draft = write_eagle3(tmp_path / "d", Eagle3Config(**{**QWEN3.__dict__, "model_type": form}))
    out = tmp_path / "fp8"
    cli_ok(["quantize", "--model_dir", str(draft), "--output_dir", str(out), "--quant_format",
            "fp8", "--ignore_layers", *ignored])  # fmt: skip
    assert verify_checkpoint(out).problems == []  # as written, it matches vLLM's names
    config = json.loads((out / "config.json").read_text())
    entries = config["quantization_config"]["ignore"]
    assert written in entries
    entries[entries.index(written)] = edited
    (out / "config.json").write_text(json.dumps(config))
    problems = verify_checkpoint(out).problems
    assert any(
        p.startswith(f"{runtime}: vLLM builds it fp8 (no ignore entry matches {runtime})")
        for p in problems
    ), problems


def test_a_tensor_parallel_size_vllm_cannot_build_the_draft_at_is_one_error_line(e3, tmp_path):
    args = ["quantize", "--model_dir", str(e3), "--quant_format", "fp8", "--tensor-parallel-size"]
    error = cli_error([*args, "3", "--output_dir", str(tmp_path / "tp3")])
    assert "num_attention_heads 4 is not a multiple of 3" in error
    assert "num_key_value_heads 2 neither divides by nor divides 3" in error
    assert not (tmp_path / "tp3").exists()
    cli_ok([*args, "4", "--output_dir", str(tmp_path / "tp4")])  # 2 key/value heads replicated
    assert verify_checkpoint(tmp_path / "tp4", 4).problems == []
