"""The draft's layers as a causal decoder streamed over a long token stream a range of positions
at a time (the boot aux regime at long context, docs/context-sweep.md "Memory"): where
:meth:`DSpark.causal_hidden` returns all of ``[S, T, L, H]`` at once (19 GB of fp32 for one
131,072-token stream at K3), a :class:`CausalStream` keeps per layer only what an MLA KV cache
holds and attends to it in key chunks (:func:`engine.cached_causal_attention`).  It equals
``causal_hidden`` to fp32 rounding (tests/test_causal_stream.py).

>>> rows = CausalStream(model, ids).rows(0, 128)  # [S, 128, L*H]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from qstream.arch.dspark_mla import engine
from qstream.arch.interface import causal_layers

if TYPE_CHECKING:
    from qstream.arch.dspark_mla.forward import DSpark


class CausalStream:
    """Every step's output of the causal pass over ids [S, T] (the layers in
    :func:`causal_layers`' order, ``depth`` of them), as ``rows(t0, t1)`` -> [S, t1 - t0,
    depth*H] in ``dtype``, taken in order from position 0 (``shape`` [S, T, depth*H])."""

    def __init__(
        self,
        model: DSpark,
        ids: torch.Tensor,
        dtype: torch.dtype = torch.float32,
        depth: int | None = None,
    ):
        c = model.config
        S, T = ids.shape
        self.model, self.ids, self.dtype = model, ids, dtype
        self.layers = causal_layers(len(model.layers), depth)
        self.shape = (S, T, len(self.layers) * c.hidden_size)
        self._latent, self._rope_key = (
            [torch.empty(S, T, d, device=model.device, dtype=model.dtype) for _ in self.layers]
            for d in (c.kv_lora_rank, c.qk_rope_head_dim)
        )
        self._next = 0

    def rows(self, t0: int, t1: int) -> torch.Tensor:
        if t0 != self._next or not t0 < t1 <= self.shape[1]:
            raise RuntimeError(f"causal rows must be taken in order: asked {t0}..{t1}")
        self._next = t1
        model = self.model
        pos = torch.arange(t0, t1, device=model.device)
        x = model.embed(self.ids[:, t0:t1].to(model.device))  # [S, t, H]
        outs = []
        for i, latent, rope_key in zip(self.layers, self._latent, self._rope_key, strict=True):
            layer = model.layers[i]
            h = layer.input_norm(x)
            latent[:, t0:t1], rope_key[:, t0:t1] = layer.latent(h, pos)
            q = layer.query(h, pos).transpose(1, 2)  # [S, n, t, dk]
            out = engine.cached_causal_attention(model, layer, q, latent[:, :t1], rope_key[:, :t1])
            x = x + layer.attention_output(out.transpose(1, 2).flatten(2))  # [S, t, H]
            x = x + layer.mlp(x)
            outs.append(x.to(self.dtype))
        return torch.stack(outs, dim=2).flatten(2)
