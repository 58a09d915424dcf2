"""Adaptive verification (vLLM 0.32, vllm/v1/worker/gpu/spec_decode/adaptive_verification.py;
docs/acceptance.md, "Adaptive verification"): the drafts of one batch's requests compete for a
budget of verified draft tokens, slots ranked by the survival ``Π_{j≤k} c_j`` of the confidence
scores; a request verifies its first ``m`` drafted tokens as a block of ``m``, so its
``P(τ ≥ k | x)`` (qstream/eval/acceptance.py) is unchanged for ``k ≤ m`` and 0 beyond.  The
budget's size is a setting here (:class:`qstream.eval.settings.AdaptiveBudget`).
"""

from __future__ import annotations

import math

import torch


def request_batches(n: int, requests: int, seed: int) -> torch.Tensor:
    """``[n]`` the batch each of ``n`` blocks is verified in: a shuffle seeded by ``seed``, then
    ``requests`` at a time (the last batch may be smaller)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    batch = torch.empty(n, dtype=torch.int64)
    batch[order] = torch.arange(n) // requests
    return batch


def admitted_drafts(
    confidence: torch.Tensor, batch: torch.Tensor, budget_share: float
) -> torch.Tensor:
    """``[n]`` int64: how many of its drafted tokens each block verifies when the blocks of each
    batch (``batch[i]``: block i's batch) share a budget of ``round(budget_share · B ·
    requests)`` tokens, as ``_assign_draft_token_budget`` admits them: every (block, position k)
    slot scored by its survival ``cumprod(c)[k]`` in float32, the batch's highest scores win, and
    a block verifies as many tokens as it has winners (a prefix: survival never increases along
    a block).  Ties, which vLLM's ``topk`` breaks as it may, go to the earlier block of the batch
    and the earlier position, so that a slot's admission depends on its own block's earlier
    scores only."""
    n, B = confidence.shape
    survival = confidence.float().cumprod(dim=1)  # [n, B]
    _, batch_of, sizes = torch.unique(batch, return_inverse=True, return_counts=True)
    order = torch.argsort(batch_of, stable=True)  # blocks by batch, in block order within one
    g = batch_of[order]
    slot = torch.arange(n) - (sizes.cumsum(0) - sizes)[g]  # [n] place within the batch
    grid = torch.full((sizes.numel(), int(sizes.max()), B), -math.inf)  # [G, R, B]
    grid[g, slot] = survival[order]  # a smaller batch's missing requests score -inf
    flat = grid.flatten(1)  # [G, R·B] request-major: earlier block, then earlier position
    ranked = torch.sort(-flat, dim=1, stable=True).indices  # best first, ties in that order
    rank = torch.empty_like(ranked).scatter_(
        1, ranked, torch.arange(flat.shape[1]).expand_as(ranked)
    )
    budget = torch.floor(budget_share * B * sizes.double() + 0.5).long()  # [G]
    wins = (rank < budget[:, None]).view_as(grid).sum(dim=-1)  # [G, R]
    admitted = torch.empty(n, dtype=torch.int64)
    admitted[order] = wins[g, slot]
    return admitted


def truncated(accept: torch.Tensor, admitted: torch.Tensor) -> torch.Tensor:
    """``accept`` [n, B] with the positions past each block's ``admitted`` count zeroed: a
    draft cut to m tokens is verified as a block of m (module docstring)."""
    keep = torch.arange(accept.shape[1]) < admitted[:, None]
    return torch.where(keep, accept, 0.0)


def estimated_emitted(confidence: torch.Tensor, admitted: torch.Tensor) -> torch.Tensor:
    """``[n]`` what vLLM's budget rule expects each block to emit, ``1 + Σ_{k≤m} Π_{j≤k} c_j``
    over its admitted positions (``get_num_tokens``: the request's sampled token plus the
    survival of its admitted slots, in float64): the confidence head's prediction of the
    target's acceptance."""
    survival = confidence.double().cumprod(dim=1)
    return 1 + truncated(survival, admitted).sum(dim=1)
