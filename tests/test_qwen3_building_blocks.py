"""The Qwen3-style DSpark forward's pieces against transformers' Qwen3 (docs/qwen3-dspark.md,
"Parity"): the draft's layers run as an ordinary causal decoder (``causal_hidden``) equal
``transformers.Qwen3Model`` built from the same weights, layer by layer, and RMSNorm, RoPE
(plain, and YaRN through ``Qwen3RotaryEmbedding``) and the SwiGLU MLP equal transformers' own
modules; fp32, relative L2 error <= 1e-5, positions past YaRN's original context included."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3Model,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from qstream.arch.dspark_qwen3 import PRESETS, Qwen3DSparkConfig, RopeParameters, tensor_shapes
from qstream.arch.dspark_qwen3.model import Qwen3DSpark, apply_rope
from qstream.arch.interface import LM_HEAD

TOL = 1e-5
POSITIONS = 200  # past the YaRN case's original 64
ROPES = {
    "plain": RopeParameters(rope_theta=10000.0),
    "yarn": RopeParameters(
        rope_theta=10000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=64
    ),
}


def draft_config(rope: str) -> Qwen3DSparkConfig:
    # max_position_embeddings = factor x original: transformers and vLLM agree on the factor
    return dataclasses.replace(
        PRESETS["qwen3-tiny"],
        num_hidden_layers=3,
        vocab_size=300,
        draft_vocab_size=300,
        rope_parameters=ROPES[rope],
        max_position_embeddings=256,
    )


def random_weights(config: Qwen3DSparkConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the draft plus lm_head: norms 1 +- 0.3, matrices ~ 1/sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {**tensor_shapes(config), LM_HEAD: (config.vocab_size, config.hidden_size)}
    out = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=g)
        if name.endswith("norm.weight"):
            out[name] = 1 + 0.3 * noise
        elif len(shape) == 2 and not name.startswith(("embed_tokens", "markov_head.markov_w1")):
            out[name] = noise / shape[-1] ** 0.5
        else:
            out[name] = noise
    return out


def hf_config(c: Qwen3DSparkConfig) -> Qwen3Config:
    config = Qwen3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=c.rope_parameters.to_json(),
        attention_bias=c.attention_bias,
        hidden_act="silu",
    )
    config._attn_implementation = "eager"
    return config


def rel(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return ((ours.double() - theirs.double()).norm() / theirs.double().norm()).item()


@pytest.fixture(scope="module", params=list(ROPES))
def pair(request):
    config = draft_config(request.param)
    weights = random_weights(config, seed=0)
    hf = Qwen3Model(hf_config(config)).eval()
    missing, _ = hf.load_state_dict(weights, strict=False)
    assert missing == []
    return config, Qwen3DSpark(config, weights, torch.float32), hf


def test_causal_hidden_equals_transformers_qwen3_layer_by_layer(pair):
    config, model, hf = pair
    ids = torch.randint(
        0, config.vocab_size, (2, POSITIONS), generator=torch.Generator().manual_seed(1)
    )
    outputs: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(lambda _m, _args, out: outputs.append(out))
        for layer in hf.layers
    ]
    with torch.no_grad():
        hf(input_ids=ids)
        ours = model.causal_hidden(ids)  # [S, T, L, H]
    for hook in hooks:
        hook.remove()
    assert ours.shape == (2, POSITIONS, config.num_hidden_layers, config.hidden_size)
    for i, theirs in enumerate(outputs):
        assert rel(ours[:, :, i], theirs) <= TOL, f"layer {i}"


def test_rope_equals_qwen3_rotary_embedding(pair):
    config, model, hf = pair
    rotary = Qwen3RotaryEmbedding(hf.config)
    assert rel(model.inv_freq, rotary.inv_freq) <= TOL
    assert config.rope_parameters.mscale == pytest.approx(rotary.attention_scaling, rel=1e-12)
    g = torch.Generator().manual_seed(2)
    heads, d = config.num_attention_heads, config.head_dim
    x = torch.randn(1, POSITIONS, heads, d, generator=g)  # qstream: [..., T, heads, d]
    pos = torch.arange(POSITIONS)
    cos, sin = rotary(x, pos[None])
    theirs, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    ours = apply_rope(x, pos, model.inv_freq, config.rope_parameters.mscale)
    assert rel(ours, theirs.transpose(1, 2)) <= TOL


def test_rms_norm_and_mlp_equal_transformers_modules(pair):
    config, model, hf = pair
    x = torch.randn(3, 5, config.hidden_size, generator=torch.Generator().manual_seed(3))
    norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    with torch.no_grad():
        norm.weight.copy_(hf.norm.weight)
        assert rel(model.norm(x, "norm"), norm(x)) <= TOL
        layer = hf.layers[1]
        assert isinstance(layer.mlp, Qwen3MLP)
        theirs = layer.mlp(layer.post_attention_layernorm(x))
        assert rel(model.mlp(1, x), theirs) <= TOL
