"""The Qwen3-style DSpark draft's forward (docs/qwen3-dspark.md, "Forward"), computed as the
DSpark-MLA one is (qstream/arch/dspark_mla/model.py) in every precision.

>>> model = Qwen3DSpark(config, weights)                  # weights: name -> tensor, + lm_head
>>> ctx = model.context(aux, lengths)                     # aux [S, T, A]: once per stream set
>>> blocks = model.draft(ctx, stream, anchor, first_token)  # U [N, B, Vd], hf [N, B, H]

As vLLM 0.32.0 computes it (vllm/model_executor/models/qwen3_dflash.py): the context
``x = RMS(fc(aux), hidden_norm)`` is projected by every layer's own k_proj (then k_norm and
RoPE) and v_proj with no input_layernorm (``DFlashQwen3Model.precompute_and_store_context_kv``);
a block of ``[ids[p], mask, ...]`` at positions p.. attends, with no causal mask, to the
context j < p and to itself (``DFlashQwen3Attention.forward``: q/k RMSNorm per head, neox RoPE,
GQA).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from qstream.arch.dspark_qwen3 import Qwen3DSparkConfig, check_tensors
from qstream.arch.family import check_blocks, context_lengths
from qstream.arch.interface import LM_HEAD, AuxChunks, Blocks
from qstream.arch.weights import CausalRows, DenseDraft
from qstream.arch.weights import apply_rope as apply_rope  # tests/test_qwen3_building_blocks.py

CONTEXT_ELEMENTS = 1 << 26  # aux elements projected at a time by context()
SCORE_BUDGET = 1 << 25  # attention score elements computed at a time


@dataclass(frozen=True)
class ContextKV:
    """Per layer, the context's keys (normed, rotated) and values at positions 0..T-1."""

    k: tuple[torch.Tensor, ...]  # [S, T, kv, d]
    v: tuple[torch.Tensor, ...]  # [S, T, kv, d]
    lengths: torch.Tensor  # [S] valid context positions per stream


class Qwen3DSpark(DenseDraft):
    """A Qwen3-style DSpark draft computing in ``dtype``: ``weights`` maps the tensor table's
    names with ``embed_tokens.weight`` and ``lm_head.weight`` to tensors of any float dtype."""

    check_tensors = staticmethod(check_tensors)

    def setup(self, weights: Mapping[str, torch.Tensor]) -> None:
        super().setup(weights)
        d2t = weights.get("d2t")  # draft id -> target id (qstream.arch.markov.draft_to_target)
        self.d2t = (
            None
            if d2t is None
            else torch.arange(len(d2t)).to(self.device) + d2t.long().to(self.device)
        )

    def layer(self, i: int, x: torch.Tensor, pos: torch.Tensor, kv, mask=None) -> torch.Tensor:
        """Layer i over x [..., T, H]; ``kv(k, v)``: what it attends to, given its own k, v."""
        h = self.norm(x, f"layers.{i}.input_layernorm")
        k, v = kv(*self.key_value(i, h, pos))
        x = x + self.proj(
            f"layers.{i}.self_attn.o_proj", self.attend(self.query(i, h, pos), k, v, mask)
        )
        return x + self.mlp(i, x)

    def context(self, aux: torch.Tensor | AuxChunks, lengths: torch.Tensor | None = None):
        """aux [S, T, A] (``lengths`` [S]: right padding) -> every layer's context keys and
        values at positions 0..T-1, projected ``CONTEXT_ELEMENTS`` at a time."""
        c = self.config
        S, T, lengths = context_lengths(c.aux_size, aux, lengths)
        step = max(1, CONTEXT_ELEMENTS // max(1, S * c.aux_size))
        pieces = []
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            rows = aux[:, t0:t1] if isinstance(aux, torch.Tensor) else aux.rows(t0, t1)
            x = self.norm(self.proj("fc", rows.to(self.device, self.dtype)), "hidden_norm")
            pos = torch.arange(t0, t1, device=self.device)
            pieces.append([self.key_value(i, x, pos) for i in range(c.num_hidden_layers)])
        k, v = (
            tuple(torch.cat([p[i][j] for p in pieces], 1) for i in range(c.num_hidden_layers))
            for j in (0, 1)
        )
        return ContextKV(k, v, lengths)

    def block_hidden(
        self, ctx: ContextKV, stream: torch.Tensor, anchor: torch.Tensor, first_token: torch.Tensor
    ) -> torch.Tensor:
        """Every slot's final-normed state [N, block_slots, H] (model dtype), as :meth:`draft_one`
        in runs of consecutive blocks within ``SCORE_BUDGET`` elements."""
        c = self.config
        stream, anchor, first_token = check_blocks(
            c.vocab_size, ctx.lengths, stream, anchor, first_token
        )
        B, kv = c.block_slots, c.num_key_value_heads * c.head_dim
        per_key = max(c.num_attention_heads * B, 2 * kv)  # score or gathered elements per key
        out = torch.empty(len(stream), B, c.hidden_size, dtype=self.dtype, device=self.device)
        j, keys = 0, anchor.tolist()
        while j < len(keys):
            k, longest = j + 1, keys[j]
            while (
                k < len(keys)
                and (k + 1 - j) * per_key * (max(longest, keys[k]) + B) <= SCORE_BUDGET
            ):
                longest, k = max(longest, keys[k]), k + 1
            out[j:k] = self._blocks(ctx, stream[j:k], anchor[j:k], first_token[j:k])
            j = k
        return out

    def _blocks(self, ctx: ContextKV, stream, anchor, first_token) -> torch.Tensor:
        c, n, B = self.config, len(anchor), self.config.block_slots
        stream, anchor = stream.to(ctx.k[0].device), anchor.to(self.device)
        T = int(anchor.max())
        tokens = torch.full((n, B), c.mask_token_id, device=self.device)
        tokens[:, 0] = first_token.to(self.device)
        pos = anchor[:, None] + torch.arange(B, device=self.device)  # [n, B]
        visible = torch.arange(T, device=self.device)[None, :] < anchor[:, None]  # [n, T]
        mask = torch.cat((visible, visible.new_ones(n, B)), 1)[:, None, :].expand(n, B, T + B)
        x = self.embed(tokens)  # [n, B, H]
        for i in range(c.num_hidden_layers):
            x = self.layer(i, x, pos, lambda k, v: (
                torch.cat((ctx.k[i][stream, :T], k), 1), torch.cat((ctx.v[i][stream, :T], v), 1)
            ), mask)  # fmt: skip
        return self.norm(x, "norm")

    def draft(
        self, ctx: ContextKV, stream: torch.Tensor, anchor: torch.Tensor, first_token: torch.Tensor
    ) -> Blocks:
        """The drafted slots' ``U = hf @ lm_head^T`` [N, B, Vd] (row k predicts ids[p+k+1]) and
        hf [N, B, H], fp32, of block n on ``stream[n]`` at ``anchor[n]`` from ``first_token[n]``."""
        hf = self.block_hidden(ctx, stream, anchor, first_token)[:, self.config.first_slot :]
        U = self.w.linear(LM_HEAD, hf)
        return Blocks(U.float(), hf.float(), torch.as_tensor(first_token).long().to(self.device))

    def draft_one(self, ctx: ContextKV, stream: int, anchor: int, first_token: int) -> Blocks:
        """One block, written to be read (docs/qwen3-dspark.md): ``[first_token, mask, ...]`` at
        positions p.. (p = ``anchor``) attend to the context j < p of ``stream`` and the block."""
        c, p = self.config, anchor
        if not 0 <= p <= int(ctx.lengths[stream]):
            raise ValueError("the anchor p must satisfy 0 <= p <= its stream's context length")
        tokens = torch.full((c.block_slots,), c.mask_token_id, device=self.device)
        tokens[0] = first_token
        pos = p + torch.arange(c.block_slots, device=self.device)
        x = self.embed(tokens)  # [B, H]
        for i in range(c.num_hidden_layers):  # every key visible
            x = self.layer(i, x, pos, lambda k, v: (
                torch.cat((ctx.k[i][stream, :p], k)), torch.cat((ctx.v[i][stream, :p], v))
            ))  # fmt: skip
        hf = self.norm(x, "norm")[c.first_slot :]
        U = self.w.linear(LM_HEAD, hf)
        return Blocks(
            U[None].float(), hf[None].float(), torch.tensor([first_token], device=self.device)
        )

    def causal_hidden(self, ids: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """The layers as a causal decoder over ids [S, T] -> [S, T, depth, H] fp32 (interface.py)."""
        stream = CausalStream(self, ids, torch.float32, depth)
        return stream.rows(0, stream.shape[1]).unflatten(-1, (len(stream.layers), -1))


class CausalStream(CausalRows):
    """:meth:`Qwen3DSpark.causal_hidden` a range of positions at a time over a KV cache per step."""

    def cache_dims(self, c: Qwen3DSparkConfig) -> tuple[tuple[int, ...], ...]:
        return (c.num_key_value_heads, c.head_dim), (c.num_key_value_heads, c.head_dim)

    def compute(self, t0: int, t1: int) -> torch.Tensor:
        step = max(1, SCORE_BUDGET // (self.model.config.num_attention_heads * t1 * self.shape[0]))
        return torch.cat([self._rows(a, min(a + step, t1)) for a in range(t0, t1, step)], 1)

    def _rows(self, t0: int, t1: int) -> torch.Tensor:
        m = self.model
        pos = torch.arange(t0, t1, device=m.device)
        mask = torch.arange(t1, device=m.device)[None, :] <= pos[:, None]  # [t, t1]
        x = m.embed(self.ids[:, t0:t1].to(m.device))  # [S, t, H]
        outs = []
        for i, (k, v) in zip(self.layers, self._cache, strict=True):

            def cache(kb, vb, k=k, v=v):
                k[:, t0:t1], v[:, t0:t1] = kb, vb
                return k[:, :t1], v[:, :t1]

            x = m.layer(i, x, pos, cache, mask)
            outs.append(x.to(self.dtype))
        return torch.stack(outs, dim=2).flatten(2)


# The FLOP model (docs/eval-drift.md, "FLOP model"), counted as the DSpark-MLA one.


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
    """Blocks at ``anchor`` [N]: every slot's layers, the drafted ones' lm_head and Markov head."""
    S, B = c.block_slots, c.block_size
    head = (c.hidden_size + c.markov_rank) * c.draft_vocab_size
    return sum(
        2.0 * (S * c.num_hidden_layers * _layer(c, p + S) + B * head) for p in anchor.tolist()
    )


def causal_flops(c: Qwen3DSparkConfig, T: int) -> float:
    """One stream's causal pass over T positions, one layer step per target aux layer."""
    q = c.num_attention_heads * c.head_dim
    return 2.0 * c.num_target_layers * (T * _layer(c, 0) + 2 * q * T * (T + 1) // 2)
