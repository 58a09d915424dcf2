"""The verification rules as a verifier runs them (samplers), for the tests: their mean must
equal the closed-form expectations of qstream/eval/acceptance.py and their output the
verifier's law.  Drafts [n, B], verifier p [n, B+1, V] (the bonus position last), drafter q
[n, B, V]; the rules are the ones qstream/eval/acceptance.py's docstring states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from qstream.eval.acceptance import accept_probabilities, token_probs


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
    P = accept_probabilities(token_probs(p[:, :B], draft), token_probs(q, draft), True)
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
