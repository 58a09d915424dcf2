"""The Qwen3-style DSpark draft's forward and loader (docs/qwen3-dspark.md): the batched
``draft`` against the readable ``draft_one``, the streamed causal pass against the whole one,
the DFlash (no Markov head) rollout, the fill-in layout, and what the loader borrows from the
target.  Parity with speculators and transformers: tests/test_speculators_parity.py and
tests/test_qwen3_building_blocks.py."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from qwen3_drafts import TINY, speculators_config, write_qwen3_draft
from safetensors.torch import save_file

from qstream.arch.dflash_qwen3 import DFlashQwen3Config
from qstream.arch.dspark_qwen3 import (
    EMBED,
    LM_HEAD,
    Qwen3DSparkConfig,
    RopeParameters,
    load_weights,
    tensor_shapes,
)
from qstream.arch.dspark_qwen3 import model as qwen3_model
from qstream.arch.dspark_qwen3.model import CausalStream, Qwen3DSpark
from qstream.arch.interface import causal_layers
from qstream.arch.markov import rollout
from qstream.errors import QStreamError

# fp32: the batched forward and draft_one sum the same products in another order (different
# GEMM shapes, softmax over more masked keys), five layers deep: about 1e-6 relative L2 here;
# the bound is the speculators parity's (tests/test_speculators_parity.py)
ORDER_REL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


YARN = replace(
    TINY,
    rope_parameters=RopeParameters(1e4, "yarn", 4.0, 64),
    max_position_embeddings=256,
)


def weights(config: Qwen3DSparkConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in tensor_shapes(config).items():
        if name.endswith("norm.weight"):
            out[name] = 1 + 0.2 * torch.randn(shape, generator=gen)
        elif len(shape) == 2:
            out[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        else:
            out[name] = 0.1 * torch.randn(shape, generator=gen)
    out[LM_HEAD] = torch.randn(config.draft_vocab_size, config.hidden_size, generator=gen) / 4
    return out


def blocks_setup(config: Qwen3DSparkConfig, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + 1)
    model = Qwen3DSpark(config, weights(config, seed))
    aux = torch.randn(3, 90, config.aux_size, generator=gen)
    lengths = torch.tensor([90, 40, 75])
    stream = torch.tensor([0, 0, 1, 2, 0, 1, 2, 2])
    anchor = torch.tensor([0, 89, 40, 3, 64, 17, 75, 74])
    first = torch.randint(0, config.vocab_size, (8,), generator=gen)
    return model, model.context(aux, lengths), stream, anchor, first


@pytest.mark.parametrize("config", [TINY, YARN], ids=["rope", "yarn"])
def test_draft_equals_one_block_at_a_time(config, monkeypatch):
    model, ctx, stream, anchor, first = blocks_setup(config)
    whole = model.draft(ctx, stream, anchor, first)
    monkeypatch.setattr(qwen3_model, "SCORE_BUDGET", 1)  # every block a run of its own
    single = model.draft(ctx, stream, anchor, first)
    for n in range(len(stream)):
        one = model.draft_one(ctx, int(stream[n]), int(anchor[n]), int(first[n]))
        for got in (whole, single):
            assert rel(got.logits_base[n], one.logits_base[0]) <= ORDER_REL
            assert rel(got.hidden[n], one.hidden[0]) <= ORDER_REL
    assert whole.logits_base.shape == (8, config.block_size, config.draft_vocab_size)


def test_a_block_sees_only_its_context_before_the_anchor():
    model, ctx, stream, anchor, first = blocks_setup(TINY)
    gen = torch.Generator().manual_seed(5)
    aux = torch.randn(1, 30, TINY.aux_size, generator=gen)
    changed = aux.clone()
    changed[0, 20:] += 1.0  # positions >= the anchor
    a = model.draft(model.context(aux), torch.tensor([0]), torch.tensor([20]), first[:1])
    b = model.draft(model.context(changed), torch.tensor([0]), torch.tensor([20]), first[:1])
    assert torch.equal(a.logits_base, b.logits_base)
    changed[0, 19] += 1.0  # the last visible position
    c = model.draft(model.context(changed), torch.tensor([0]), torch.tensor([20]), first[:1])
    assert not torch.equal(a.logits_base, c.logits_base)


def test_fill_in_layout_drafts_from_slot_one():
    fill = replace(TINY, sample_from_anchor=False)
    assert (fill.block_size, fill.first_slot) == (TINY.block_slots - 1, 1)
    model, ctx, stream, anchor, first = blocks_setup(fill)
    slots = model.block_hidden(ctx, stream, anchor, first)
    blocks = model.draft(ctx, stream, anchor, first)
    assert torch.equal(blocks.hidden, slots[:, 1:].float())


def test_causal_stream_in_pieces_equals_the_whole_pass():
    model = Qwen3DSpark(TINY, weights(TINY))
    ids = torch.randint(0, TINY.vocab_size, (2, 37), generator=torch.Generator().manual_seed(3))
    whole = model.causal_hidden(ids)
    assert whole.shape == (2, 37, TINY.num_hidden_layers, TINY.hidden_size)
    stream = CausalStream(model, ids)
    parts = torch.cat([stream.rows(0, 1), stream.rows(1, 20), stream.rows(20, 37)], 1)
    assert rel(parts, whole.flatten(2)) <= ORDER_REL
    with pytest.raises(RuntimeError, match="in order"):
        stream.rows(0, 5)


def test_a_deeper_causal_pass_runs_the_stack_again_on_its_own_output():
    """The boot regime on a draft with fewer layers than aux layers (the shipped GSM8K pair:
    2 for 5): ``depth`` steps run the layers in order and again, which is exactly a draft of
    ``depth`` layers whose upper layers copy the lower ones; the first L steps are the plain
    pass, and the streamed pass in pieces equals the whole one."""
    shallow = replace(TINY, num_hidden_layers=2)
    deep = replace(TINY, num_hidden_layers=5)
    w = weights(shallow)
    copied = dict(w)
    for name, tensor in w.items():
        for src, copies in (("layers.0.", (2, 4)), ("layers.1.", (3,))):
            if name.startswith(src):
                copied.update({name.replace(src, f"layers.{j}.", 1): tensor for j in copies})
    ids = torch.randint(0, TINY.vocab_size, (2, 29), generator=torch.Generator().manual_seed(5))
    model = Qwen3DSpark(shallow, w)
    got = model.causal_hidden(ids, depth=5)
    assert got.shape == (2, 29, 5, TINY.hidden_size)
    assert torch.equal(got, Qwen3DSpark(deep, copied).causal_hidden(ids))
    assert torch.equal(got[:, :, :2], model.causal_hidden(ids))
    stream = CausalStream(model, ids, depth=5)
    assert stream.shape == (2, 29, 5 * TINY.hidden_size)
    parts = torch.cat([stream.rows(0, 4), stream.rows(4, 29)], 1)
    assert rel(parts, got.flatten(2)) <= ORDER_REL


def test_causal_layers_repeat_the_stack_in_order():
    assert causal_layers(5) == [0, 1, 2, 3, 4]
    assert causal_layers(2, 5) == [0, 1, 0, 1, 0]
    assert causal_layers(5, 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="layers and steps"):
        causal_layers(2, 0)


def test_a_dflash_draft_drafts_its_base_logits():
    dflash = replace(TINY, markov_rank=0, enable_confidence_head=False,
                     confidence_head_with_markov=False)  # fmt: skip
    model, ctx, stream, anchor, first = blocks_setup(dflash)
    blocks = model.draft(ctx, stream, anchor, first)
    greedy = rollout(model, blocks)
    assert torch.equal(greedy.tokens, blocks.logits_base.argmax(-1))
    assert greedy.confidence is None


def _target(directory, config, tied=False):
    gen = torch.Generator().manual_seed(9)
    shape = (config.vocab_size, config.hidden_size)
    tensors = {"model.embed_tokens.weight": torch.randn(shape, generator=gen).bfloat16()}
    if not tied:
        tensors["lm_head.weight"] = torch.randn(shape, generator=gen).bfloat16()
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    return tensors


@pytest.mark.parametrize("tied", [False, True])
def test_loader_borrows_embedding_and_head_from_the_target(tmp_path, tied):
    draft = write_qwen3_draft(tmp_path / "draft", embed=False)
    lent = _target(tmp_path / "target", TINY, tied)
    got = load_weights(draft, tmp_path / "target", TINY)
    assert torch.equal(got[EMBED], lent["model.embed_tokens.weight"])
    head = lent["model.embed_tokens.weight" if tied else "lm_head.weight"]
    assert torch.equal(got[LM_HEAD], head)
    Qwen3DSpark(TINY, got)  # everything the forward needs


def test_loader_without_a_target_names_what_is_missing(tmp_path):
    draft = write_qwen3_draft(tmp_path / "draft", embed=False)
    with pytest.raises(QStreamError, match="no embed_tokens.weight or lm_head.weight of its own"):
        load_weights(draft, None, TINY)


def test_loader_refuses_a_d2t_that_maps_outside_the_target_vocabulary(tmp_path):
    reduced = replace(TINY, draft_vocab_size=512)
    draft = write_qwen3_draft(tmp_path / "draft", reduced)
    from safetensors.torch import load_file

    tensors = load_file(draft / "model.safetensors")
    tensors["d2t"] = torch.full((512,), TINY.vocab_size, dtype=torch.int64)
    save_file(tensors, draft / "model.safetensors")
    with pytest.raises(
        QStreamError, match=r"d2t\[0\] = 1024 maps draft id 0 to target id 1024, outside"
    ):
        load_weights(draft, None, reduced)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads = 3 must divide num_attention_heads"),
        ({"markov_head_type": "gated"}, "markov_head_type = 'gated' must be 'vanilla'"),
        ({"layer_types": ["sliding_attention"] * 5}, "sliding-window layers"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_type = 'llama3'"),
        ({"target_layer_ids": [0, 8]}, r"target_layer_ids = \[0, 8\] must be layer indices"),
        ({"hidden_size": "64"}, "hidden_size = '64' must be a positive integer"),
        ({"is_causal": True}, "is_causal = True makes a block-causal draft"),
        ({"dflash_config": {"causal": True}}, "dflash_config.causal = True makes a block-causal"),
        ({"dflash_config": {"use_swa": True}}, "dflash_config.use_swa = True makes sliding"),
        ({"is_neox_style": False}, "is_neox_style = False makes interleaved RoPE"),
        ({"dflash_config": {"attention_value_scale": 0.5}}, "attention_value_scale = 0.5"),
        ({"dflash_config": {"attention_sink_bias": True}}, "attention_sink_bias = True"),
        ({"add_swa_attention_sink_bias": True}, "add_swa_attention_sink_bias = True"),
        ({"logit_scale": 0.5}, "logit_scale = 0.5 makes scaled logits"),
        ({"use_aux_hidden_state": False}, "use_aux_hidden_state = False makes a draft without fc"),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e4,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "attention_factor": 2.0,
                }
            },
            "rope_parameters.attention_factor = 2.0 is not evaluated",
        ),  # fmt: skip
    ],
)
def test_config_errors_name_the_key(change, message):
    data = {**TINY.to_json(), **change}
    with pytest.raises(ValueError, match=message):
        Qwen3DSparkConfig.from_json(data)


def test_speculators_layout_reads_into_the_same_config():
    t, data = TINY, speculators_config(TINY)
    assert Qwen3DSparkConfig.from_json(data) == replace(t, target_num_hidden_layers=None)
    data.pop("sample_from_anchor")  # vLLM reads a missing key as false in this layout
    assert Qwen3DSparkConfig.from_json(data).sample_from_anchor is False


def test_the_legacy_rope_layout_reads_into_rope_parameters():
    data = {k: v for k, v in YARN.to_json().items() if k != "rope_parameters"}
    data.update(rope_theta=1e4, rope_scaling={"type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 64})  # fmt: skip
    assert Qwen3DSparkConfig.from_json(data) == YARN


def test_dense_layout_reads_what_vllm_reads_first():
    """vLLM takes the mask token from dflash_config before the top level, and the target layers
    from eagle_aux_hidden_state_layer_ids (hidden-states indices) before dflash_config and the
    top level."""
    data = {**TINY.to_json(), "mask_token_id": 7, "dflash_config": {"mask_token_id": 9}}
    assert Qwen3DSparkConfig.from_json(data).mask_token_id == 9
    data["eagle_aux_hidden_state_layer_ids"] = [2, 4, 6, 7, 8]
    data["dflash_config"]["target_layer_ids"] = [0, 1, 2, 3, 4]
    assert Qwen3DSparkConfig.from_json(data).target_layer_ids == (1, 3, 5, 6, 7)
    del data["eagle_aux_hidden_state_layer_ids"]
    assert Qwen3DSparkConfig.from_json(data).target_layer_ids == (0, 1, 2, 3, 4)


def test_a_speculators_dflash_draft_vllm_runs_block_causal_is_refused():
    data = {
        "speculators_model_type": "dflash",
        "transformer_layer_config": {"hidden_size": 64},
        "sliding_window_non_causal": False,
    }
    with pytest.raises(ValueError, match="sliding_window_non_causal = False makes a block-causal"):
        DFlashQwen3Config.from_json(data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_reduced_vocabulary_maps_its_ids_through_d2t_in_every_dtype(dtype):
    reduced = replace(TINY, draft_vocab_size=512)
    tensors = weights(reduced)
    tensors["d2t"] = torch.full((512,), 100, dtype=torch.int64)  # draft id d is target d + 100
    model = Qwen3DSpark(reduced, tensors, dtype)
    assert model.d2t is not None and torch.equal(model.d2t, torch.arange(512) + 100)
