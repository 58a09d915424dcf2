"""Speculative-decoding verification of drafted blocks: token-wise rejection sampling and block
verification, as samplers and as exact per-block expectations (docs/acceptance.md).

For ``n`` blocks of ``B`` drafted tokens ``x_1..x_B`` over a vocabulary of ``V``:

- ``q[:, k]`` is the drafter's sampling distribution at position k (conditioned on ``x_{<k}``),
- ``p[:, k]`` the verifier's sampling distribution at position k, conditioned on the *drafted*
  prefix ``x_{<k}``; ``p[:, B]`` (the bonus position) is needed by the samplers only.

Rules (k counts from 1 in the formulas, from 0 in the tensors; ``r_k = p_k(x_k) / q_k(x_k)``):

- **token-wise** (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
  Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"): accept
  ``x_k`` with probability ``min(1, r_k)``, stop at the first rejection and resample that position
  from ``norm(max(0, p_k − q_k))``; when all B are accepted, draw a bonus token from ``p_{B+1}``.
- **block** (Sun et al. 2024, "Block Verification Accelerates Speculative Decoding", Algorithm 2;
  vLLM's ``rejection_sample_method: "block"``): ``P_0 = 1``, ``P_k = min(1, P_{k-1} r_k)``; the
  residual after accepting k tokens is ``max(0, P_k p_{k+1} − q_{k+1})`` with mass ``Z_{k+1}``;
  ``h_k = Z_{k+1} / (Z_{k+1} + 1 − P_k)`` for k < B and ``h_B = P_B``; with independent uniforms
  ``η_k``, the accepted length is ``τ = max{k : η_k ≤ h_k}`` (0 if none), followed by one token
  from the residual of ``τ`` (``τ < B``) or from ``p_{B+1}`` (``τ = B``).

Both emit ``τ + 1`` tokens per block (at most B+1) whose distribution is the verifier's.

**Expectations.** Given the drafted prefix ``x_{≤k}``, the probability that the verifier accepts
at least k tokens is, marginalising over its own uniforms and over the later drafted tokens,
``Π_{j≤k} min(1, r_j)`` (token-wise) and ``P_k`` (block: the choice of ``h`` makes
``P(τ ≥ k | x_{≤k}) = P_k``; Sun et al., proof of Theorem 1).  So ``1 + Σ_k P(τ ≥ k | x_{≤k})`` is
an unbiased, lower-variance (Rao–Blackwellised) estimate of the expected number of tokens emitted
per block, from a single drafted block and no verifier randomness.  Per draft the block value is
never below the token-wise one, since ``min(1, P_{k-1} r_k) ≥ P_{k-1} min(1, r_k)``.

**Greedy drafting against a sampling verifier** (vLLM's default ``draft_sample_method``
"greedy" at a temperature > 0): the drafter's argmax is treated as a one-hot draft, ``q_k(x_k)
= 1`` (vLLM 0.32, rejection_sampler_utils.py: ``_compute_global_logprobs_and_logsumexp`` and
``_compute_global_residual_mass`` without draft logits).  Token-wise then accepts ``x_k`` with
probability ``p_k(x_k)`` and resamples from ``p_k`` with ``x_k`` removed.  Block verification
gets ``P_k = Π_{j≤k} p_j(x_j)`` (never capped: each factor is at most 1) and
``Z_{k+1} = P_k (1 − p_{k+1}(x_{k+1}))``: its ``P(τ ≥ k | x) = P_k`` is the token-wise value and
its residual is the same, so with a deterministic draft the two rules emit the same law (one
verifier's uniforms give different outcomes under each).

**Adaptive verification** (vLLM 0.32, adaptive_verification.py): the drafts of the requests of
one batch compete for a budget of verified draft tokens.  Each (request, position k) slot is
scored by its survival ``Π_{j≤k} c_j`` (c: the confidence head's sigmoid scores) and the
budget's best slots are admitted (``_assign_draft_token_budget``); a request verifies its first
``m`` drafted tokens and the rest are dropped before the target sees them.  A truncated draft is
verified as a block of ``m`` tokens, so its ``P(τ ≥ k | x)`` is unchanged for ``k ≤ m`` and 0
beyond.  Whether position k is admitted depends on ``c_{≤k}``, which read the drafted tokens
before k only (``c_k`` reads ``markov_w1[x_{k-1}]``): the truncation is decided before the
token it drops is verified, and the emitted tokens keep the verifier's law.  The budget's size
comes from step costs vLLM profiles on the serving GPU (``get_num_tokens``); it is a setting
here (docs/acceptance.md).

**Verifying on a stream the verifier sampled itself.** When the only prefixes whose verifier
distribution is known are those of a token stream ``s`` drawn from the verifier (captured target
states), the same expectation is ``E_{s~p}[Σ_k w_k(s)]`` with the importance weight
``w_k = P(τ ≥ k | s_{≤k}) · q(s_{≤k}) / p(s_{≤k})``: token-wise ``Π_{j≤k} min(1, q_j/p_j)``, block
``min(1, min_{i≤k} Π_{j≤i} q_j/p_j)`` (the running minimum of the cumulative likelihood ratio).
Both weights lie in [0, 1], and they are unbiased because a prefix the verifier cannot produce
(``p = 0`` somewhere) is never accepted by either rule.  A greedy draft is the one-hot
``q_j = [s_j = x_j]`` (x_j the drafter's argmax on the stream's prefix): both weights are then
``[s_{≤k} = x_{≤k}]``, whose expectation over the stream is ``p(x_{≤k}) = P(τ ≥ k | x)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from qstream.eval.estimates import (
    Estimate,
    mean_estimate,
    pooled_proportion,
    proportion,
    scaled,
)
from qstream.eval.vocabulary import ACCEPTANCE_MODES, RULES

# ---------------------------------------------------------------------------------------------
# Exact per-block expectations


def _check(p_tok: torch.Tensor, q_tok: torch.Tensor) -> None:
    if p_tok.ndim != 2 or p_tok.shape != q_tok.shape:
        raise ValueError(
            f"token probabilities must be two equal [n, B] tensors, got "
            f"{tuple(p_tok.shape)} and {tuple(q_tok.shape)}"
        )


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


def accept_probabilities(p_tok: torch.Tensor, q_tok: torch.Tensor, rule: str) -> torch.Tensor:
    """``[n, B]`` float64: P(τ ≥ k | drafted prefix x_{≤k}) for k = 1..B, from the verifier's
    and the drafter's probabilities of the drafted tokens (``p_tok[:, k] = p_k(x_k)``)."""
    _check(p_tok, q_tok)
    p, q = p_tok.double(), q_tok.double()
    ratio = torch.where(q > 0, p / q, torch.where(p > 0, torch.inf, 0.0))
    if rule == "token_wise":
        return ratio.clamp(max=1.0).cumprod(dim=1)
    if rule == "block":
        return _guarded_product(ratio, cap=1.0)
    raise ValueError(f"unknown rule {rule!r}; choose from {', '.join(RULES)}")


def stream_weights(p_tok: torch.Tensor, q_tok: torch.Tensor, rule: str) -> torch.Tensor:
    """``[n, B]`` float64 importance weights ``w_k`` for blocks read off a stream sampled from the
    verifier (module docstring): ``E_{s~p}[w_k] = P(τ ≥ k)`` under drafting from q.  A stream
    token the verifier cannot produce (``p = 0``) breaks that premise; it is given ratio +inf,
    so it neither adds nor removes acceptance on its own (see ``outside_verifier_support``)."""
    _check(p_tok, q_tok)
    p, q = p_tok.double(), q_tok.double()
    ratio = torch.where(p > 0, q / p, torch.where(q > 0, torch.inf, 1.0))
    if rule == "token_wise":
        return ratio.clamp(max=1.0).cumprod(dim=1)
    if rule == "block":
        return torch.cummin(_guarded_product(ratio, cap=None).clamp(max=1.0), dim=1).values
    raise ValueError(f"unknown rule {rule!r}; choose from {', '.join(RULES)}")


def greedy_accepts(draft_tokens: torch.Tensor, verifier_top1: torch.Tensor) -> torch.Tensor:
    """``[n, B]`` float64 0/1: greedy drafting against a greedy verifier accepts token k iff every
    drafted token up to k equals the verifier's argmax on that (drafted) prefix."""
    if draft_tokens.shape != verifier_top1.shape or draft_tokens.ndim != 2:
        raise ValueError("draft tokens and verifier argmax must be equal [n, B] tensors")
    return ((draft_tokens != verifier_top1).cumsum(dim=1) == 0).double()


def greedy_draft_probabilities(p_tok: torch.Tensor, rule: str) -> torch.Tensor:
    """``[n, B]`` float64: P(τ ≥ k | drafted prefix) for a greedy draft (a one-hot q) verified by
    a sampling verifier: ``Π_{j≤k} p_j(x_j)`` under either rule (module docstring)."""
    return accept_probabilities(p_tok, torch.ones_like(p_tok), rule)


def greedy_draft_stream_weights(
    p_tok: torch.Tensor, drafted_is_stream: torch.Tensor, rule: str
) -> torch.Tensor:
    """:func:`stream_weights` of a greedy drafter: ``drafted_is_stream[:, k]`` says whether the
    drafter's argmax on the stream's prefix is the stream's token k (its one-hot q there)."""
    return stream_weights(p_tok, drafted_is_stream.double(), rule)


# ---------------------------------------------------------------------------------------------
# Adaptive verification (vLLM 0.32, vllm/v1/worker/gpu/spec_decode/adaptive_verification.py)


@dataclass(frozen=True)
class AdaptiveBudget:
    """How adaptive verification is simulated: the blocks of an evaluation, shuffled by ``seed``,
    are taken ``requests`` at a time as the requests of one batch, whose verified draft tokens
    are ``budget_share`` of their drafted ones (rounded to the nearest token).  vLLM sizes that
    budget from profiled step costs; here it is given."""

    requests: int
    budget_share: float
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if not 0 <= self.budget_share <= 1:
            raise ValueError(f"budget_share must be in [0, 1], got {self.budget_share}")

    def to_json(self) -> dict:
        return {"requests": self.requests, "budget_share": self.budget_share}

    def batches(self, n: int) -> torch.Tensor:
        """``[n]`` the batch each of ``n`` blocks is verified in (a seeded shuffle, then
        ``requests`` at a time; the last batch may be smaller)."""
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed))
        batch = torch.empty(n, dtype=torch.int64)
        batch[order] = torch.arange(n) // self.requests
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


def token_probs(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``probs[..., tokens]``: [n, B, V], [n, B] -> [n, B]."""
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# Samplers (the rules as a verifier runs them; used to check the expectations and the output law)


@dataclass(frozen=True)
class Verified:
    accepted: torch.Tensor  # [n] τ, 0..B
    tokens: torch.Tensor  # [n, B+1] emitted tokens x_1..x_τ, y; -1 after position τ


def _draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` [n, V] (rows need not be normalised)."""
    return torch.multinomial(probs.double(), 1, generator=generator).squeeze(1)


def _emit(draft: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> Verified:
    n, B = draft.shape
    keep = torch.arange(B + 1) < accepted[:, None]
    tokens = torch.where(keep, torch.cat((draft, draft[:, :1]), dim=1), -1)
    tokens[torch.arange(n), accepted] = last
    return Verified(accepted, tokens)


def _residual(p_next: torch.Tensor, q_next: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``max(0, scale·p − q)`` [n, V]; where it has no mass the verifier's own p (that row's
    residual is never drawn from: its rule cannot stop there)."""
    res = (scale[:, None] * p_next - q_next).clamp(min=0.0)
    return torch.where(res.sum(-1, keepdim=True) > 0, res, p_next)


def _finish(draft, p, q, accepted, scale_at, generator) -> Verified:
    n, B = draft.shape
    rows = torch.arange(n)
    at = accepted.clamp(max=B - 1)
    residual = _residual(p[rows, at].double(), q[rows, at].double(), scale_at)
    bonus = p[:, B].double()
    last = torch.where(accepted == B, _draw(bonus, generator), _draw(residual, generator))
    return _emit(draft, accepted, last)


class Verifier(Protocol):
    """A sampler of a verification rule: drafts [n, B], p [n, B+1, V], q [n, B, V]."""

    def __call__(
        self, draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator
    ) -> Verified: ...


def verify_token_wise(
    draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator
) -> Verified:
    """Token-wise rejection sampling of drafts [n, B] with p [n, B+1, V] and q [n, B, V]."""
    n, B = draft.shape
    ratio = token_probs(p[:, :B].double(), draft) / token_probs(q.double(), draft)
    u = torch.rand(n, B, dtype=torch.float64, generator=generator)
    accepted = (u < ratio).long().cumprod(dim=1).sum(dim=1)
    return _finish(draft, p, q, accepted, torch.ones(n, dtype=torch.float64), generator)


def verify_block(
    draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator
) -> Verified:
    """Block verification (Sun et al. 2024, Algorithm 2) of drafts [n, B] with p [n, B+1, V] and
    q [n, B, V]."""
    n, B = draft.shape
    P = accept_probabilities(token_probs(p[:, :B], draft), token_probs(q, draft), "block")
    h = torch.empty(n, B, dtype=torch.float64)
    for k in range(B - 1):  # h_k for k = 1..B-1 (tensor column k-1): residual at position k+1
        mass = (P[:, k, None] * p[:, k + 1].double() - q[:, k + 1].double()).clamp(min=0).sum(-1)
        denom = mass + 1 - P[:, k]
        h[:, k] = torch.where(denom > 0, mass / denom.clamp(min=torch.finfo(denom.dtype).tiny), 1.0)
    h[:, B - 1] = P[:, B - 1]
    eta = torch.rand(n, B, dtype=torch.float64, generator=generator)
    passed = torch.where(eta <= h, torch.arange(1, B + 1), 0)
    accepted = passed.max(dim=1).values
    P_with_0 = torch.cat((torch.ones(n, 1, dtype=torch.float64), P), dim=1)
    return _finish(draft, p, q, accepted, P_with_0[torch.arange(n), accepted], generator)


def verify_truncated(
    verify: Verifier,
    draft: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    admitted: torch.Tensor,
    generator: torch.Generator,
) -> Verified:
    """Adaptive verification's trimmed drafts: each block's first ``admitted`` tokens verified by
    ``verify`` as a block of that length (nothing admitted: one token drawn from ``p_1``)."""
    n, B = draft.shape
    accepted = torch.zeros(n, dtype=torch.int64)
    tokens = torch.full((n, B + 1), -1, dtype=torch.int64)
    for m in torch.unique(admitted).tolist():
        rows = (admitted == m).nonzero().squeeze(1)
        if m == 0:
            tokens[rows, 0] = _draw(p[rows, 0].double(), generator)
            continue
        part = verify(draft[rows, :m], p[rows, : m + 1], q[rows, :m], generator)
        accepted[rows] = part.accepted
        tokens[rows, : m + 1] = part.tokens
    return Verified(accepted, tokens)


# ---------------------------------------------------------------------------------------------
# Accumulation over batches


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
    """``[n, B]`` per-block P(τ ≥ k) -> :class:`AcceptanceSummary` (Student t over blocks).
    ``outcomes``: the values are 0/1 outcomes (greedy), which get Wilson intervals instead —
    per position over blocks, and for the emitted tokens ``1 + B ·`` the pooled share on the
    design-effect sample size — so that a run where every block is accepted does not report
    the zero-width interval Student t gives there."""
    B = accept.shape[1]
    if outcomes:
        hits = accept > 0.5
        return AcceptanceSummary(
            emitted=scaled(pooled_proportion(hits), B, offset=1.0),
            prefix_accept=tuple(proportion(hits[:, k]) for k in range(B)),
        )
    return AcceptanceSummary(
        emitted=mean_estimate(1 + accept.sum(dim=1), bounds=(1.0, B + 1.0)),
        prefix_accept=tuple(mean_estimate(accept[:, k], bounds=(0.0, 1.0)) for k in range(B)),
    )


class AcceptanceAccumulator:
    """Per-block acceptance of one drafter against one verifier, batch by batch, per mode
    (``vocabulary.ACCEPTANCE_MODES``), and the drafter's confidence scores per draft method, from
    which the adaptive modes are derived when the results are read (their batches span the
    whole evaluation).  :meth:`emitted` gives the per-block values for paired comparisons."""

    def __init__(self, temperature: float, adaptive: AdaptiveBudget | None = None) -> None:
        self.temperature, self.adaptive = temperature, adaptive
        self._parts: dict[str, list[torch.Tensor]] = {}
        self._confidence: dict[str, list[torch.Tensor]] = {}
        self._outcomes: set[str] = set()  # modes whose values are 0/1 outcomes
        self._admitted: dict[str, torch.Tensor] = {}

    def add(self, mode: str, accept: torch.Tensor, outcomes: bool = False) -> None:
        """One batch's ``[n, B]`` P(τ ≥ k) of a non-adaptive mode; ``outcomes``: they are 0/1."""
        if ACCEPTANCE_MODES[mode].adaptive:
            raise ValueError(f"{mode} is derived from its base mode, not added")
        self._parts.setdefault(mode, []).append(accept.double().cpu())
        if outcomes:
            self._outcomes.add(mode)

    def add_confidence(self, draft: str, confidence: torch.Tensor | None) -> None:
        """One batch's ``[n, B]`` confidence scores of the drafts made by ``draft`` (None: the
        model has no confidence head, and no adaptive mode is simulated)."""
        if confidence is not None:
            self._confidence.setdefault(draft, []).append(confidence.float().cpu())

    def modes(self) -> list[str]:
        """The modes held, in ACCEPTANCE_MODES order; an adaptive one when its base mode, its
        draft's confidence scores and an adaptive budget are all there."""
        return [key for key in ACCEPTANCE_MODES if self._holds(key)]

    def _holds(self, key: str) -> bool:
        mode = ACCEPTANCE_MODES[key]
        if not mode.adaptive:
            return key in self._parts
        held = mode.base in self._parts and mode.draft in self._confidence
        return held and self.adaptive is not None

    def admitted(self, mode: str) -> torch.Tensor:
        """``[n]`` drafted tokens each block verifies under an adaptive ``mode``."""
        if mode not in self._admitted:
            assert self.adaptive is not None  # modes() lists adaptive modes only with it
            confidence = torch.cat(self._confidence[ACCEPTANCE_MODES[mode].draft])
            batches = self.adaptive.batches(confidence.shape[0])
            self._admitted[mode] = admitted_drafts(confidence, batches, self.adaptive.budget_share)
        return self._admitted[mode]

    def accept(self, mode: str) -> torch.Tensor:
        spec = ACCEPTANCE_MODES[mode]
        if spec.adaptive:
            return truncated(self.accept(spec.base), self.admitted(mode))
        return torch.cat(self._parts[mode])

    def emitted(self, mode: str) -> torch.Tensor:
        """``[n]`` expected tokens emitted per block, in the order the batches were added."""
        return 1 + self.accept(mode).sum(dim=1)

    def to_json(self) -> dict:
        return {mode: self._mode_json(mode) for mode in self.modes()}

    def _mode_json(self, mode: str) -> dict:
        spec = ACCEPTANCE_MODES[mode]
        accept = self.accept(mode)
        B = accept.shape[1]
        adaptive = self.adaptive.to_json() if self.adaptive is not None else None
        out = {
            "mode": spec.to_json(self.temperature, adaptive),
            **summarise(accept, outcomes=spec.base in self._outcomes).to_json(),
        }
        if spec.adaptive:
            admitted = self.admitted(mode)
            confidence = torch.cat(self._confidence[spec.draft])
            out["verified"] = admitted.double().mean().item()
            out["estimated_emitted"] = mean_estimate(
                estimated_emitted(confidence, admitted), bounds=(1.0, B + 1.0)
            ).to_json()
        return out


def paired_loss(floor: torch.Tensor, other: torch.Tensor, block_size: int) -> dict:
    """Mean per-block loss ``floor − other`` of emitted tokens (same blocks, same noise), with a
    Student-t 95% interval over blocks: the loss against bf16."""
    return mean_estimate(floor - other, bounds=(-block_size, block_size)).to_json()
