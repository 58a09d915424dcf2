"""Parity of the DSpark building blocks with an independent implementation: transformers'
DeepSeek-V3 (MLA attention with rope_interleave, YaRN frequencies, RMSNorm, SwiGLU MLP), given
the same weights and config."""

from dataclasses import replace

import pytest
import torch
from model_helpers import random_model_weights
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

from qstream.arch.dspark_mla import PRESETS
from qstream.arch.dspark_mla.model import DSpark
from qstream.arch.weights import inv_freq, rms_norm, swiglu

# float32 rounding: both implementations sit within 1.7e-6 of a float64 run of themselves on
# these shapes (outputs up to |3.1|, i.e. ~4 ulps); 1e-5 is that doubled and rounded up.
FP32_ATOL = 1e-5


def _hf_config(cfg):
    yarn = cfg.rope_parameters
    hf = DeepseekV3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        first_k_dense_replace=10,
        rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": cfg.rope_theta,
            "factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "beta_fast": yarn.beta_fast,
            "beta_slow": yarn.beta_slow,
            "mscale": yarn.mscale,
            "mscale_all_dim": yarn.mscale_all_dim,
        },
    )
    hf._attn_implementation = "eager"
    return hf


def _close(a, b, what):
    err = (a - b).abs().max().item()
    assert err <= FP32_ATOL, f"{what}: max |diff| {err:.3g} > {FP32_ATOL}"
    return err


def test_yarn_inv_freq_matches_transformers():
    for name in ("tiny", "k3"):
        cfg = PRESETS[name]
        rotary = ds.DeepseekV3RotaryEmbedding(_hf_config(cfg))
        assert rotary.attention_scaling == 1.0  # cos/sin factor 1: mscale == mscale_all_dim
        ours = inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_parameters)
        torch.testing.assert_close(ours, rotary.inv_freq, rtol=0, atol=0)


def _scaled_mscale(cfg):
    """cfg with mscale 2, mscale_all_dim 1: a cos/sin factor other than 1."""
    yarn = replace(cfg.rope_parameters, mscale=2.0, mscale_all_dim=1.0)
    return replace(cfg, rope_parameters=yarn)


def test_rope_mscale_matches_transformers_attention_scaling():
    for cfg in (PRESETS["k3"], _scaled_mscale(PRESETS["k3"]), _scaled_mscale(PRESETS["tiny"])):
        rotary = ds.DeepseekV3RotaryEmbedding(_hf_config(cfg))
        assert abs(cfg.rope_mscale - rotary.attention_scaling) < 1e-12


def test_softmax_scale_matches_transformers_and_design():
    cfg = PRESETS["k3"]
    hf_scale = ds.yarn_apply_mscale(_hf_config(cfg).rope_parameters, cfg.qk_head_dim**-0.5)
    assert abs(cfg.softmax_scale - hf_scale) < 1e-12
    assert round(cfg.softmax_scale, 6) == 0.130861  # docs/model.md


@pytest.mark.parametrize("scaled", [False, True], ids=["mscale=1", "mscale=2"])
def test_decoder_layer_matches_transformers_in_causal_mode(scaled):
    cfg = _scaled_mscale(PRESETS["tiny"]) if scaled else PRESETS["tiny"]
    weights = random_model_weights(cfg, seed=3)
    model = DSpark(cfg, weights)
    layer = ds.DeepseekV3DecoderLayer(_hf_config(cfg), layer_idx=0).eval()
    state = {k[len("layers.0.") :]: v for k, v in weights.items() if k.startswith("layers.0.")}
    layer.load_state_dict(state, strict=True)
    # transformers builds q_a_layernorm / kv_a_layernorm with its default eps 1e-6; vLLM and
    # docs/model.md use config.rms_norm_eps for every norm, so align the reference to that.
    layer.self_attn.q_a_layernorm.variance_epsilon = cfg.rms_norm_eps
    layer.self_attn.kv_a_layernorm.variance_epsilon = cfg.rms_norm_eps
    rotary = ds.DeepseekV3RotaryEmbedding(_hf_config(cfg))

    S, T, H = 2, 40, cfg.hidden_size
    x = torch.randn(S, T, H, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(T)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]  # [1, 1, T, T] additive causal
    with torch.no_grad():
        cos_sin = rotary(x, pos[None].expand(S, T))
        h = layer.input_layernorm(x)
        ref_attn, _ = layer.self_attn(h, position_embeddings=cos_sin, attention_mask=mask)
        ref_out = layer(x, attention_mask=mask, position_embeddings=cos_sin)

    ours_h = rms_norm(x, weights["layers.0.input_layernorm.weight"], cfg.rms_norm_eps)
    _close(ours_h, h, "RMSNorm")
    _close(model.attention_causal(0, ours_h, pos), ref_attn, "MLA attention")
    after_attn = x + model.attention_causal(0, ours_h, pos)
    _close(after_attn + model.layers[0].mlp(after_attn), ref_out, "decoder layer")


def test_swiglu_and_rmsnorm_match_transformers():
    cfg = PRESETS["tiny"]
    hf = _hf_config(cfg)
    gen = torch.Generator().manual_seed(5)
    mlp = ds.DeepseekV3MLP(hf)
    norm = ds.DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    with torch.no_grad():
        for p in (*mlp.parameters(), *norm.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        x = torch.randn(3, 17, cfg.hidden_size, generator=gen) * 4
        _close(
            swiglu(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight),
            mlp(x),
            "SwiGLU",
        )
        _close(rms_norm(x, norm.weight, cfg.rms_norm_eps), norm(x), "RMSNorm")
