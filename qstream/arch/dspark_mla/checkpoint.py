"""The DSpark-MLA draft's checkpoint: docs/model.md's tensor table for a config and the strict
check of a checkpoint's key set and shapes against it; loading (strict, memory-mapped,
quantized checkpoints dequantized, the target's lm_head borrowed); and how vLLM serves it, as
data.  Pure Python at import (``qstream quantize`` checks a draft's shapes against the table):
torch and the checkpoint reader are imported where a call needs them.

>>> weights = load_weights("ckpt/")          # name -> tensor, lm_head from ckpt/target_head/
>>> weights = load_weights("ckpt-nvfp4/", target="kimi-k3/")
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from qstream.arch import config_fields
from qstream.arch.dspark_mla.config import DSparkConfig
from qstream.arch.family import borrow_from_target, check_table, shape_hint
from qstream.arch.interface import EMBED, LM_HEAD

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------------------------------------
# The tensor table


def tensor_shapes(config: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """The draft checkpoint's tensors and shapes, in checkpoint order (docs/model.md's tensor table)."""
    c = config
    n, H = c.num_attention_heads, c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        EMBED: (c.vocab_size, H),
        "context_proj.weight": (H, c.aux_size),
        "context_norm.weight": (H,),
    }
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "self_attn.q_a_proj.weight": (c.q_lora_rank, H),
                p + "self_attn.q_a_layernorm.weight": (c.q_lora_rank,),
                p + "self_attn.q_b_proj.weight": (n * c.qk_head_dim, c.q_lora_rank),
                p + "self_attn.kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, H),
                p + "self_attn.kv_a_layernorm.weight": (c.kv_lora_rank,),
                p + "self_attn.kv_b_proj.weight": (
                    n * (c.qk_nope_head_dim + c.v_head_dim),
                    c.kv_lora_rank,
                ),
                p + "self_attn.o_proj.weight": (H, n * c.v_head_dim),
                p + "post_attention_layernorm.weight": (H,),
                p + "mlp.gate_proj.weight": (c.intermediate_size, H),
                p + "mlp.up_proj.weight": (c.intermediate_size, H),
                p + "mlp.down_proj.weight": (H, c.intermediate_size),
            }
        )
    shapes["final_norm.weight"] = (H,)
    return {**shapes, **config_fields.head_shapes(c, c.vocab_size)}


def check_tensors(
    config: DSparkConfig,
    shapes: Mapping[str, tuple[int, ...]],
    where: str,
    extra: Mapping[str, tuple[int, ...]] | None = None,
) -> None:
    """Strict check: exactly the expected names (plus ``extra``), each with its exact shape.
    Raises QStreamError naming the first offender and ``where`` it was found."""
    expected = {**tensor_shapes(config), **(extra or {})}
    check_table(expected, expected, shapes, where, "DSpark draft",
                lambda name, shape: shape_hint(config, name, shape))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(directory: str | Path) -> DSparkConfig:
    """config.json of a draft checkpoint -> DSparkConfig (QStreamError naming key and value)."""
    return config_fields.load_config(directory, DSparkConfig.from_json)


def read_draft_tensors(
    directory: str | Path, config: DSparkConfig | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the draft checkpoint, quantized ones dequantized (4-bit formats to
    bf16, FP8 to its scale's dtype), strictly checked against the config: nothing missing,
    nothing unexplained, every shape exact.  ``embed_tokens.weight`` may be absent (then it
    must come from the target)."""
    from qstream.checkpoint.read import read_draft_checkpoint

    directory = Path(directory)
    config = config or load_config(directory)
    tensors, _ = read_draft_checkpoint(directory)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if EMBED not in shapes:
        shapes[EMBED] = (config.vocab_size, config.hidden_size)  # checked when borrowed
    check_tensors(config, shapes, str(directory))
    return tensors


def load_weights(
    model_dir: str | Path, target: str | Path | None = None, config: DSparkConfig | None = None
) -> dict[str, torch.Tensor]:
    """Everything the model (:class:`.model.DSpark`) needs: the draft's tensors (dequantized) plus
    ``lm_head.weight`` (and ``embed_tokens.weight`` if the draft has none) from ``target``,
    which defaults to ``model_dir/target_head`` as written by ``qstream synth``."""
    model_dir = Path(model_dir)
    config = config or load_config(model_dir)
    tensors = read_draft_tensors(model_dir, config)
    borrowed = [LM_HEAD] + ([EMBED] if EMBED not in tensors else [])
    expected = (config.vocab_size, config.hidden_size)
    from_target = borrow_from_target(model_dir, target, borrowed, expected, "lm_head")
    return {**tensors, **from_target}


# ---------------------------------------------------------------------------------------------
# How vLLM 0.32.0 serves the draft (vllm/models/kimi_k3/nvidia/dspark_mla.py), as data:
# SERVING is the K3DSparkModel serving profile that qstream/vllm/profiles.py builds
# (docs/vllm.md cites each rule).


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
