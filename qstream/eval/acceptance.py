"""Speculative-decoding verification of drafted blocks: token-wise rejection sampling and block
verification as exact per-block expectations (docs/acceptance.md).  Adaptive verification's
trimming is qstream/eval/adaptive.py's; the tallies over a regime, qstream/eval/tally.py's.

For ``n`` blocks of ``B`` drafted tokens ``x_1..x_B`` over a vocabulary of ``V``:

- ``q[:, k]`` is the drafter's sampling distribution at position k (conditioned on ``x_{<k}``),
- ``p[:, k]`` the verifier's sampling distribution at position k, conditioned on the *drafted*
  prefix ``x_{<k}``; ``p[:, B]`` (the bonus position) is needed by a sampler only (the rules as a verifier runs
  them: tests/verification_samplers.py, which checks these expectations against them).

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


def token_probs(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``probs[..., tokens]``: [n, B, V], [n, B] -> [n, B]."""
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
