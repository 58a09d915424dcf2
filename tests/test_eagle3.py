"""The EAGLE-3 draft (docs/eagle3.md): `qstream synth --preset eagle3-tiny`, its config in vLLM's
and speculators' layouts, the checkpoint's Error lines, and the forward's own consistency (its
parity with speculators 0.9.0 is tests/test_speculators_eagle3.py, in the speculators lane)."""

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import cli_ok
from safetensors.torch import load_file, save_file

from qstream.arch.eagle3 import ARCH, PRESETS, Eagle3Config, tensor_shapes
from qstream.arch.interface import EMBED, TARGET_HEAD_DIR
from qstream.arch.registry import architecture_of, load_config
from qstream.errors import QStreamError
from qstream.serving import REFERENCE_VARIANT
from qstream.synth.draft import synth_checkpoint


@pytest.fixture(scope="module")
def e3(tmp_path_factory) -> Path:
    return Path(synth_checkpoint("eagle3-tiny", tmp_path_factory.mktemp("e3") / "d").output_dir)


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
