"""Speculative-decoding verification of drafted blocks: token-wise rejection sampling and block
verification as exact per-block expectations (docs/acceptance.md).  Adaptive verification's
trimming is qstream/eval/adaptive.py's; the tallies over a regime, qstream/eval/tally.py's.

For ``n`` blocks of ``B`` drafted tokens over a vocabulary of ``V``: ``q[:, k]`` is the drafter's
sampling distribution at position k, ``p[:, k]`` the verifier's on the *drafted* prefix
(``p[:, B]``, the bonus position, is needed by a sampler only: tests/verification_samplers.py runs
the rules and checks these expectations against them).  The rules, the exact per-block
expectation ``1 + Σ_k P(τ ≥ k | x_{≤k})`` that replaces the verifier's randomness, the one-hot
greedy draft, and the importance weights on a stream the verifier sampled itself are derived in
docs/acceptance.md ("Rules", "What is reported").
"""

from __future__ import annotations

import torch

from qstream.eval.vocabulary import RULES


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
    verifier (docs/acceptance.md): ``E_{s~p}[w_k] = P(τ ≥ k)`` under drafting from q.  A stream
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
    a sampling verifier: ``Π_{j≤k} p_j(x_j)`` under either rule (docs/acceptance.md)."""
    return accept_probabilities(p_tok, torch.ones_like(p_tok), rule)


def greedy_draft_stream_weights(
    p_tok: torch.Tensor, drafted_is_stream: torch.Tensor, rule: str
) -> torch.Tensor:
    """:func:`stream_weights` of a greedy drafter: ``drafted_is_stream[:, k]`` says whether the
    drafter's argmax on the stream's prefix is the stream's token k (its one-hot q there)."""
    return stream_weights(p_tok, drafted_is_stream.double(), rule)


def token_probs(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``probs[..., tokens]``: [n, B, V], [n, B] -> [n, B]."""
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
