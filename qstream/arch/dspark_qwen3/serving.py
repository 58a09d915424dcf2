"""How vLLM 0.32.0 serves the Qwen3-style DSpark draft (vllm/model_executor/models/
qwen3_dspark.py over qwen3_dflash.py), as data: :data:`SERVING` is the ``Qwen3DSparkModel``
serving profile that qstream/vllm/profiles.py builds (docs/vllm.md, "The Qwen3-style DSpark
draft", cites each rule)."""

from __future__ import annotations

from typing import Any

# Checkpoint module (under layers.{i}.) -> (runtime module under model.layers.{L+i}., split).
# q/k/v load into one qkv_proj (a QKVParallelLinear), gate/up into gate_up_proj (a
# MergedColumnParallelLinear): DFlashQwen3Model.hf_to_vllm_mapper's orig_to_new_stacked; the
# splits are DFlashQwen3Attention.__init__'s and Qwen2MLP's (qwen3_dflash.py, qwen2.py).
LAYER_MODULES = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "out"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "out"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "out"),
    "self_attn.o_proj": ("self_attn.o_proj", "in"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "out"),
    "mlp.up_proj": ("mlp.gate_up_proj", "out"),
    "mlp.down_proj": ("mlp.down_proj", "in"),
}
# DFlashQwen3Model.__init__: fc is a ReplicatedLinear built with the draft's quant config.
CONTEXT_PROJ = "fc"
# Modules vLLM never builds quantized, with the reason (docs/vllm.md cites each).
NEVER_QUANTIZED = {
    "markov_head.markov_w1": "the Markov head's markov_w1 is an nn.Embedding, built without a "
    "quant config",
    "confidence_head.proj": (
        "the DSpark confidence head is an fp32 ReplicatedLinear built without a quant config "
        "(served for adaptive verification)"
    ),
    "lm_head": "Qwen3DSparkForCausalLM builds the draft's own lm_head as a ParallelLMHead "
    "without a quant config",
    "embed_tokens": "the draft's embedding is a VocabParallelEmbedding built without a quant "
    "config",
}
# markov_w2 is a ParallelLMHead built WITH the draft's quant config (DSparkMarkovHead.__init__):
# CompressedTensorsConfig.get_quant_method gives it a scheme only when a config group target
# names it (its class name holds no "linear", so the "Linear" target misses it); vLLM 0.32.0
# then loads it in each of qstream's formats (the vLLM lane proves it).  Runtime name, the target
# qstream writes for it, the formats.
LM_HEADS = {
    "markov_head.markov_w2": {
        "runtime": "model.markov_head.markov_w2",
        "target": "re:.*\\.markov_head\\.markov_w2$",
        "formats": ("fp8", "nvfp4", "mxfp4"),
    },
}
# The module kinds a shipped draft quantizes by default: the backbone's Linear layers and fc
# (the descriptor's quantize_include, docs/qwen3-dspark.md, "What is quantized").
DEFAULT_INCLUDE = (
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "fc",
)
SERVING: dict[str, Any] = {
    "name": "Qwen3DSparkModel",
    "architectures": ("Qwen3DSparkModel",),
    "layer_modules": LAYER_MODULES,
    "never_quantized": NEVER_QUANTIZED,
    "context_proj": CONTEXT_PROJ,
    "lm_heads": LM_HEADS,
    "default_include": DEFAULT_INCLUDE,
    "gqa_heads": ("num_attention_heads", "num_key_value_heads"),
    # vLLM 0.32.0's update_dspark (vllm/transformers_utils/configs/speculators/algos.py) serves
    # a saved speculators DSpark config as Qwen3DSparkModel, whatever its "architectures" says
    "speculators_types": ("dspark",),
}
