"""The draft checkpoint's tensors: names and shapes of docs/model.md's tensor table for a
config, and the strict check of a checkpoint's key set and shapes against it."""

from __future__ import annotations

from collections.abc import Mapping

from qstream.arch.dspark_mla.config import DSparkConfig
from qstream.arch.family import CONFIDENCE_WEIGHT, check_table, shape_hint


def tensor_shapes(config: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """The draft checkpoint's tensors and shapes, in checkpoint order (docs/model.md's tensor table)."""
    c = config
    n, H, r = c.num_attention_heads, c.hidden_size, c.markov_rank
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (c.vocab_size, H),
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
    shapes["markov_head.markov_w1.weight"] = (c.vocab_size, r)
    shapes["markov_head.markov_w2.weight"] = (c.vocab_size, r)
    if c.enable_confidence_head:
        shapes[CONFIDENCE_WEIGHT] = (1, H + (r if c.confidence_head_with_markov else 0))
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


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
