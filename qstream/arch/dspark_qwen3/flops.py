"""The Qwen3-style DSpark draft's FLOP model (docs/eval-drift.md, "FLOP model"): 2 FLOPs per
multiply-add of the work the draft must do; norms, softmax, masking and sampling not counted."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qstream.arch.dspark_qwen3.config import Qwen3DSparkConfig

if TYPE_CHECKING:
    import torch


def context_flops(c: Qwen3DSparkConfig) -> float:
    """One context position: fc, then every layer's key and value projections."""
    kv = 2 * c.num_key_value_heads * c.head_dim
    return 2.0 * (c.aux_size * c.hidden_size + c.num_hidden_layers * c.hidden_size * kv)


def _layer(c: Qwen3DSparkConfig, keys: int) -> int:
    """Multiply-adds of one layer at one position attending to ``keys`` keys."""
    H, q = c.hidden_size, c.num_attention_heads * c.head_dim
    kv = 2 * c.num_key_value_heads * c.head_dim
    return H * (q + kv) + q * H + 3 * H * c.intermediate_size + 2 * keys * q


def drafted_flops(c: Qwen3DSparkConfig, anchor: torch.Tensor) -> float:
    """Blocks at ``anchor`` [N]: every slot of each attends to its context and the block; the
    drafted positions then run lm_head and the Markov head."""
    S, B = c.block_slots, c.block_size
    head = (c.hidden_size + c.markov_rank) * c.draft_vocab_size
    return sum(
        2.0 * (S * c.num_hidden_layers * _layer(c, p + S) + B * head) for p in anchor.tolist()
    )


def causal_flops(c: Qwen3DSparkConfig, T: int) -> float:
    """One stream's causal pass over T positions (the boot regime: one layer step per target
    aux layer): every step at every position, position t attending to the t + 1 keys up to
    itself."""
    q = c.num_attention_heads * c.head_dim
    return 2.0 * c.num_target_layers * (T * _layer(c, 0) + 2 * q * T * (T + 1) // 2)
