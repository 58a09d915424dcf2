"""How vLLM 0.32.0 serves the DSpark-MLA draft (vllm/models/kimi_k3/nvidia/dspark_mla.py), as
data: :data:`SERVING` is the ``K3DSparkModel`` serving profile that qstream/vllm/profiles.py
builds (docs/vllm.md cites each rule)."""

from __future__ import annotations

# Checkpoint module (under layers.{i}.) -> (runtime module under model.layers.{L+i}., split).
# q_a/kv_a load into one fused_qkv_a_proj, gate/up into gate_up_proj
# (K3DSparkForCausalLM.hf_to_vllm_mapper's orig_to_new_stacked); the splits are those of
# vllm/models/kimi_k3/nvidia/mla.py MultiHeadLatentAttention and model.py KimiMLP.
LAYER_MODULES = {
    "self_attn.q_a_proj": ("self_attn.fused_qkv_a_proj", "none"),
    "self_attn.kv_a_proj_with_mqa": ("self_attn.fused_qkv_a_proj", "none"),
    "self_attn.q_b_proj": ("self_attn.q_b_proj", "out"),
    "self_attn.kv_b_proj": ("self_attn.kv_b_proj", "out"),
    "self_attn.o_proj": ("self_attn.o_proj", "in"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "out"),
    "mlp.up_proj": ("mlp.gate_up_proj", "out"),
    "mlp.down_proj": ("mlp.down_proj", "in"),
}
CONTEXT_PROJ = "context_proj"
CONTEXT_KV = "model.context_kv_proj"
# Modules vLLM never builds quantized, with the reason (docs/vllm.md cites each).  In vLLM
# 0.32.0, K3DSparkModel.__init__ builds DSparkMarkovHead and, when config.json sets
# enable_confidence_head, DSparkConfidenceHead (an fp32 ReplicatedLinear, served for adaptive
# verification) without a quant config; K3DSparkForCausalLM.hf_to_vllm_mapper drops
# embed_tokens (the target's is shared).
NEVER_QUANTIZED = {
    "markov_head.markov_w1": "the DSpark Markov head is built without a quant config",
    "markov_head.markov_w2": "the DSpark Markov head is built without a quant config",
    "confidence_head.proj": (
        "the DSpark confidence head is built in fp32 without a quant config "
        "(served for adaptive verification)"
    ),
    "embed_tokens": "the draft's embedding is an embedding table, not a Linear layer",
}
# q_a_proj and kv_a_proj_with_mqa of every layer are one fused group: each layer fuses its pair
# into fused_qkv_a_proj, and every layer's kv_a is loaded again into the one context_kv_proj.
CROSS_LAYER = (
    ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
    "self_attn.{q_a_proj, kv_a_proj_with_mqa} of every layer",
    "vLLM fuses each layer's pair into fused_qkv_a_proj and loads every layer's "
    "kv_a_proj_with_mqa again into one cross-layer context_kv_proj",
)
SERVING = {
    "name": "K3DSparkModel",
    "architectures": ("K3DSparkModel",),
    "layer_modules": LAYER_MODULES,
    "never_quantized": NEVER_QUANTIZED,
    "context_proj": CONTEXT_PROJ,
    "context_kv": CONTEXT_KV,
    "cross_layer": CROSS_LAYER,
}
