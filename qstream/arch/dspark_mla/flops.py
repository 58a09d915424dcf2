"""The draft's FLOP model (docs/eval-drift.md, "FLOP model"): 2 FLOPs per multiply-add of the
work the draft must do.  Norms, softmax, masking, upcasts and sampling are not counted.

It serves three readers: the batching engine weighs a padding slot against a row's context
expansion, eval-drift's progress bar takes its ETA from the work left, and evals/ divide it by
the seconds a pass took.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qstream.arch.dspark_mla.config import DSparkConfig

if TYPE_CHECKING:
    import torch


def expand_flops(c: DSparkConfig) -> float:
    """One context key expanded to every head's key and value, in every layer (kv_b_proj)."""
    L, n = c.num_hidden_layers, c.num_attention_heads
    return 2.0 * L * c.kv_lora_rank * n * (c.qk_nope_head_dim + c.v_head_dim)


def context_flops(c: DSparkConfig) -> float:
    """One context position: the context projection, then each layer's latent and rope key
    (kv_a_proj_with_mqa) and its expansion."""
    latent = c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)
    return 2.0 * (c.aux_size * c.hidden_size + c.num_hidden_layers * latent) + expand_flops(c)


def position_flops(c: DSparkConfig, keys: int) -> float:
    """One drafted position that attends to ``keys`` keys (its context plus the block): every
    layer's projections and attention, then lm_head and the Markov head."""
    return 2.0 * (
        c.num_hidden_layers * _layer(c, keys) + (c.hidden_size + c.markov_rank) * c.vocab_size
    )


def causal_flops(c: DSparkConfig, T: int) -> float:
    """One stream's causal pass over T positions (the boot regime's aux states, one layer step
    per target aux layer): every step at every position, position t attending to the t + 1 keys
    up to itself."""
    per_key = c.num_attention_heads * (c.qk_head_dim + c.v_head_dim)
    return 2.0 * c.num_target_layers * (T * _layer(c, 0) + per_key * T * (T + 1) // 2)


def _layer(c: DSparkConfig, keys: int) -> int:
    """Multiply-adds of one layer at one position attending to ``keys`` keys."""
    H, n = c.hidden_size, c.num_attention_heads
    return (
        H * c.q_lora_rank
        + c.q_lora_rank * n * c.qk_head_dim
        + H * (c.kv_lora_rank + c.qk_rope_head_dim)
        + c.kv_lora_rank * n * (c.qk_nope_head_dim + c.v_head_dim)
        + n * c.v_head_dim * H
        + 3 * H * c.intermediate_size
        + keys * n * (c.qk_head_dim + c.v_head_dim)
    )


def drafted_flops(c: DSparkConfig, anchor: torch.Tensor) -> float:
    """Blocks at ``anchor`` [N]: their B positions each, each attending to its context and the
    block (no context projection)."""
    B = c.block_size
    return sum(B * position_flops(c, p + B) for p in anchor.tolist())


def blocks_flops(c: DSparkConfig, stream: torch.Tensor, anchor: torch.Tensor) -> float:
    """Blocks at ``anchor`` of ``stream`` [N]: their B positions each, plus each stream's
    context up to its longest anchor, computed once (a batch's padding is not useful work)."""
    context = sum(longest_anchors(stream, anchor).values())
    return drafted_flops(c, anchor) + context * context_flops(c)


def longest_anchors(stream: torch.Tensor, anchor: torch.Tensor) -> dict[int, int]:
    """Each stream's largest anchor among blocks (stream, anchor) [N]: the context it needs."""
    longest: dict[int, int] = {}
    for s, p in zip(stream.tolist(), anchor.tolist()):
        longest[s] = max(longest.get(s, 0), p)
    return longest
