"""Acceptance (docs/acceptance.md, "Rules", "What is reported"): speculative-decoding verification
of drafted blocks as exact per-block expectations ``1 + Σ_k P(τ ≥ k | x_{≤k})``, adaptive
verification's trimming (vllm/v1/worker/gpu/spec_decode/adaptive_verification.py: a request
verifies its first ``m`` drafted tokens as a block of ``m``), and the tallies of one drafter
against one verifier.  Shapes: ``q[:, k]`` the drafter's distribution, ``p[:, k]`` the verifier's
on the drafted prefix, [n, B]; tests/verification_samplers.py runs the rules by sampling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qstream.eval.estimates import Estimate, mean_estimate, per_position, pooled_proportion, scaled
from qstream.eval.settings import AdaptiveBudget
from qstream.verification import MODES, VerificationMode


def _checked(p_tok: torch.Tensor, q_tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if p_tok.ndim != 2 or p_tok.shape != q_tok.shape:
        raise ValueError(
            f"token probabilities must be two equal [n, B] tensors, got "
            f"{tuple(p_tok.shape)} and {tuple(q_tok.shape)}"
        )
    return p_tok.double(), q_tok.double()


def _guarded_product(ratio: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Running ``L_k = L_{k-1} · ratio_k`` (optionally capped: ``min(cap, ·)``) over [n, B], with
    0 absorbing: a zero factor zeroes the rest even after an infinite one (no 0·inf = NaN)."""
    out = torch.empty_like(ratio)
    running = torch.ones(ratio.shape[0], dtype=ratio.dtype)
    for k in range(ratio.shape[1]):
        dead = (running == 0) | (ratio[:, k] == 0)
        running = torch.where(dead, 0.0, running * ratio[:, k])
        if cap is not None:
            running = running.clamp(max=cap)
        out[:, k] = running
    return out


def _by_rule(ratio: torch.Tensor, block: bool, stream: bool) -> torch.Tensor:
    """``[n, B]`` from per-position ratios: token-wise ``Π_{j≤k} min(1, r_j)``; ``block``, the
    running product capped at 1 (drafting) or ``min_{i≤k} min(1, Π_{j≤i} r_j)`` (``stream``)."""
    if not block:
        return ratio.clamp(max=1.0).cumprod(dim=1)
    if not stream:
        return _guarded_product(ratio, cap=1.0)
    return torch.cummin(_guarded_product(ratio, cap=None).clamp(max=1.0), dim=1).values


def accept_probabilities(p_tok: torch.Tensor, q_tok: torch.Tensor, block: bool) -> torch.Tensor:
    """``[n, B]`` float64: P(τ ≥ k | drafted prefix x_{≤k}) for k = 1..B, from the verifier's
    and the drafter's probabilities of the drafted tokens (``p_tok[:, k] = p_k(x_k)``), under
    block verification or (not ``block``) token-wise."""
    p, q = _checked(p_tok, q_tok)
    return _by_rule(torch.where(q > 0, p / q, torch.where(p > 0, torch.inf, 0.0)), block, False)


def stream_weights(p_tok: torch.Tensor, q_tok: torch.Tensor, block: bool) -> torch.Tensor:
    """``[n, B]`` float64 importance weights ``w_k``, ``E_{s~p}[w_k] = P(τ ≥ k)``, for blocks of
    a stream sampled from the verifier; a token the verifier cannot produce (``p = 0``) gets ratio
    +inf, neither adding nor removing acceptance on its own."""
    p, q = _checked(p_tok, q_tok)
    return _by_rule(torch.where(p > 0, q / p, torch.where(q > 0, torch.inf, 1.0)), block, True)


def greedy_accepts(draft_tokens: torch.Tensor, verifier_top1: torch.Tensor) -> torch.Tensor:
    """``[n, B]`` float64 0/1: greedy drafting against a greedy verifier accepts token k iff every
    drafted token up to k equals the verifier's argmax on that (drafted) prefix."""
    if draft_tokens.shape != verifier_top1.shape or draft_tokens.ndim != 2:
        raise ValueError("draft tokens and verifier argmax must be equal [n, B] tensors")
    return ((draft_tokens != verifier_top1).cumsum(dim=1) == 0).double()


def greedy_draft_probabilities(p_tok: torch.Tensor, block: bool) -> torch.Tensor:
    """``[n, B]`` float64: P(τ ≥ k | drafted prefix) for a greedy draft (a one-hot q) verified by
    a sampling verifier: ``Π_{j≤k} p_j(x_j)`` under either rule (docs/acceptance.md)."""
    return accept_probabilities(p_tok, torch.ones_like(p_tok), block)


def greedy_draft_stream_weights(
    p_tok: torch.Tensor, drafted_is_stream: torch.Tensor, block: bool
) -> torch.Tensor:
    """:func:`stream_weights` of a greedy drafter: ``drafted_is_stream[:, k]`` says whether the
    drafter's argmax on the stream's prefix is the stream's token k (its one-hot q there)."""
    return stream_weights(p_tok, drafted_is_stream.double(), block)


def token_probs(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``probs[..., tokens]``: [n, B, V], [n, B] -> [n, B]."""
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


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
    """``[n]`` int64 drafted tokens each block verifies when each batch (``batch[i]``) shares
    ``round(budget_share · B · requests)`` tokens as ``_assign_draft_token_budget`` admits them:
    slots scored by survival ``cumprod(c)[k]`` in float32, the highest win (a prefix per block).
    Ties, which vLLM's ``topk`` breaks as it may, go to the earlier block and position, so a
    slot's admission depends on its own block's earlier scores only."""
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
    """``[n]`` what vLLM's budget rule (``get_num_tokens``, float64) expects each block to emit,
    ``1 + Σ_{k≤m} Π_{j≤k} c_j`` over its admitted positions."""
    survival = confidence.double().cumprod(dim=1)
    return 1 + truncated(survival, admitted).sum(dim=1)


@dataclass(frozen=True)
class AcceptanceSummary:
    """Expected tokens emitted per block (accepted + one resampled or bonus token, 1..B+1) and
    P(τ ≥ k) per position, each a mean over blocks with its 95% interval."""

    emitted: Estimate
    prefix_accept: tuple[Estimate, ...]

    def to_json(self) -> dict:
        return {
            "emitted": self.emitted.to_json(),
            "prefix_accept": [e.to_json() for e in self.prefix_accept],
        }


def summarise(accept: torch.Tensor, outcomes: bool = False) -> AcceptanceSummary:
    """``[n, B]`` per-block P(τ ≥ k) -> :class:`AcceptanceSummary` (Student t over blocks);
    0/1 ``outcomes`` (greedy) get Wilson intervals (emitted: ``1 + B ·`` the pooled share), which
    keep width where every block is accepted."""
    B = accept.shape[1]
    if outcomes:
        hits = accept > 0.5
        return AcceptanceSummary(
            emitted=scaled(pooled_proportion(hits), B, offset=1.0),
            prefix_accept=per_position(hits),
        )
    return AcceptanceSummary(
        emitted=mean_estimate(1 + accept.sum(dim=1), bounds=(1.0, B + 1.0)),
        prefix_accept=tuple(mean_estimate(accept[:, k], bounds=(0.0, 1.0)) for k in range(B)),
    )


class AcceptanceAccumulator:
    """Per-block acceptance of one drafter against one verifier per mode, and the confidence
    scores per draft method from which the adaptive modes are derived when read (their batches
    span the whole evaluation, shuffled by ``seed``)."""

    def __init__(self, temperature: float, adaptive: AdaptiveBudget, seed: int) -> None:
        self.temperature, self.adaptive, self.seed = temperature, adaptive, seed
        self._parts: dict[VerificationMode, list[torch.Tensor]] = {}
        self._confidence: dict[bool, list[torch.Tensor]] = {}  # by mode.probabilistic
        self._outcomes: set[VerificationMode] = set()  # modes whose values are 0/1 outcomes
        self._admitted: dict[VerificationMode, torch.Tensor] = {}

    def add(self, mode: VerificationMode, accept: torch.Tensor, outcomes: bool = False) -> None:
        """One batch's ``[n, B]`` P(τ ≥ k) of a non-adaptive mode; ``outcomes``: they are 0/1."""
        if mode.adaptive:
            raise ValueError(f"{mode.name} is derived from its base mode, not added")
        self._parts.setdefault(mode, []).append(accept.double().cpu())
        if outcomes:
            self._outcomes.add(mode)

    def add_confidence(self, probabilistic: bool, confidence: torch.Tensor | None) -> None:
        """One batch's ``[n, B]`` confidence scores of the probabilistic or the greedy drafts
        (None: the model has no confidence head, and no adaptive mode is simulated)."""
        if confidence is not None:
            self._confidence.setdefault(probabilistic, []).append(confidence.float().cpu())

    def modes(self) -> list[VerificationMode]:
        """The modes held, in MODES order; an adaptive one when its base mode and its draft's
        confidence scores are both there."""
        return [
            mode
            for mode in MODES.values()
            if (mode.base if mode.adaptive else mode) in self._parts
            and (not mode.adaptive or mode.probabilistic in self._confidence)
        ]

    def admitted(self, mode: VerificationMode) -> torch.Tensor:
        """``[n]`` drafted tokens each block verifies under an adaptive ``mode``."""
        if mode not in self._admitted:
            confidence = torch.cat(self._confidence[mode.probabilistic])
            batches = request_batches(confidence.shape[0], self.adaptive.requests, self.seed)
            self._admitted[mode] = admitted_drafts(confidence, batches, self.adaptive.budget_share)
        return self._admitted[mode]

    def accept(self, mode: VerificationMode) -> torch.Tensor:
        if mode.adaptive:
            return truncated(self.accept(mode.base), self.admitted(mode))
        return torch.cat(self._parts[mode])

    def emitted(self, mode: VerificationMode) -> torch.Tensor:
        """``[n]`` expected tokens emitted per block, in the order the batches were added."""
        return 1 + self.accept(mode).sum(dim=1)

    def to_json(self) -> dict:
        return {mode.name: self._mode_json(mode) for mode in self.modes()}

    def _mode_json(self, mode: VerificationMode) -> dict:
        accept = self.accept(mode)
        B = accept.shape[1]
        out = {
            "mode": mode.to_json(self.temperature, self.adaptive.to_json()),
            **summarise(accept, outcomes=mode.base in self._outcomes).to_json(),
        }
        if mode.adaptive:
            admitted = self.admitted(mode)
            confidence = torch.cat(self._confidence[mode.probabilistic])
            out["verified"] = admitted.double().mean().item()
            out["estimated_emitted"] = mean_estimate(
                estimated_emitted(confidence, admitted), bounds=(1.0, B + 1.0)
            ).to_json()
        return out


def paired_loss(floor: torch.Tensor, other: torch.Tensor, block_size: int) -> dict:
    """Mean per-block loss ``floor − other`` of emitted tokens (same blocks, same noise), with a
    Student-t 95% interval over blocks: the loss against bf16."""
    return mean_estimate(floor - other, bounds=(-block_size, block_size)).to_json()
