"""The synthetic draft's Markov head from corpus statistics (docs/model.md, "Synthetic
checkpoint layout"): bigram log-probabilities of the tokenized corpus, their low-rank
``markov_w1`` / ``markov_w2`` factors, and the scale that calibrates the head's top-1 accuracy."""

from __future__ import annotations

import math

import torch

TARGET_TOP1 = 0.55  # the real U is not iid: measured top-1 on GSM8K lands ~0.07 above this
CALIBRATION_SAMPLES = 4096  # corpus transitions used to set the Markov scale (+-0.01 top-1)
BIGRAM_FLOOR = 0.03  # best rank-16 top-1 accuracy on GSM8K among 1e-4 .. 0.1 (12.8%)
DEGENERATE = 1e-9  # singular values closer than this (relative to the largest) are one eigenspace
U_STD = 1.5  # nats: per-vocab spread of the network logits U (as synth's lm_head gives it)


def bigram_logprobs(streams: list[list[int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``log P(next | prev)`` [vocab, vocab] (add-one-unigram smoothed, floored at
    BIGRAM_FLOOR so the low-rank fit spends its rank on likely continuations) and the count of
    each prev token [vocab]."""
    seqs = [torch.tensor(ids, dtype=torch.int64) for ids in streams]
    pairs = torch.cat([t[:-1] * vocab + t[1:] for t in seqs if t.numel() > 1])
    counts = torch.bincount(pairs, minlength=vocab * vocab).view(vocab, vocab).double()
    unigram = torch.bincount(torch.cat(seqs), minlength=vocab).double()
    p_uni = (unigram + 0.5) / (unigram.sum() + 0.5 * vocab)
    p = (counts + p_uni) / (counts.sum(1, keepdim=True) + 1.0)
    return p.clamp(min=BIGRAM_FLOOR).log(), counts.sum(1)


def markov_tables(
    logp: torch.Tensor, prev_counts: torch.Tensor, vocab: int, rank: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """markov_w1, markov_w2 [vocab, rank] with ``w2 @ w1[a]`` ~ row-centred ``logp[a]``.
    Column rank-1 is a bias column (w1 = 1; w2 = the count-weighted mean next-token
    log-probability, and a large negative value for padding ids beyond the tokenizer); the
    other rank-1 columns are an SVD of the rest weighted by how often each prev token occurs
    (frequent contexts get the rank: +50% top-1 accuracy at rank 16 on GSM8K)."""
    vt = logp.shape[0]
    weight = (prev_counts + 1.0)[:, None]  # [vt, 1]
    centred = logp - logp.mean(1, keepdim=True)
    col_mean = (centred * weight).sum(0) / weight.sum()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        u, s, v = torch.svd_lowrank(  # float64: the same factors on every CPU (synth/draft.py)
            (centred - col_mean) * weight.sqrt(), q=min(rank - 1 + 16, vt), niter=6
        )
    u, v = _canonical(u, s, v)
    root = s[: rank - 1].sqrt()
    gen = torch.Generator().manual_seed(seed + 17)
    w1 = torch.randn(vocab, rank, generator=gen, dtype=torch.float64) * 0.1
    w2 = torch.randn(vocab, rank, generator=gen, dtype=torch.float64) * 0.1
    w1[:vt, : rank - 1] = u[:, : rank - 1] * root / weight.sqrt()
    w2[:vt, : rank - 1] = v[:, : rank - 1] * root
    w1[:, rank - 1] = 1.0
    w2[:vt, rank - 1] = col_mean
    w2[vt:, rank - 1] = -30.0  # padding ids are never predicted
    return w1, w2


def _canonical(
    u: torch.Tensor, s: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Singular vectors fixed by the matrix alone, not by the routine that found them.  Where
    singular values repeat (GSM8K-like corpora give exact repeats: tokens seen in the same
    contexts), any rotation of their vectors is as good, and which one LAPACK returns follows the
    thread count; each such eigenspace is rotated onto the eigenvectors of a fixed generic
    operator, diag(0..n-1), restricted to it.  Every sign is then set by a fixed generic vector
    (never by the largest entry: structured vectors such as (e_a - e_b)/sqrt(2) tie)."""
    u, v = u.clone(), v.clone()
    n, k = u.shape
    ramp = torch.arange(n, dtype=u.dtype)[:, None]  # [n, 1]
    start = 0
    while start < k:
        end = start + 1
        while end < k and float(s[end - 1] - s[end]) <= DEGENERATE * float(s[0]):
            end += 1
        if end - start > 1:
            block = u[:, start:end]  # [n, m]
            _, w = torch.linalg.eigh(block.T @ (ramp * block))  # [m, m]
            u[:, start:end], v[:, start:end] = block @ w, v[:, start:end] @ w
        start = end
    weights = torch.arange(1, n + 1, dtype=u.dtype)[:, None].sqrt()  # [n, 1]
    sign = torch.where((u * weights).sum(0) < 0, -1.0, 1.0)
    return _flush(u * sign), _flush(v * sign)


def _flush(x: torch.Tensor) -> torch.Tensor:
    """Entries that are zero in exact arithmetic (rows of tokens never seen) come out of the SVD
    as 1e-13-sized noise, different on every CPU, which bf16 would keep; they become 0."""
    return torch.where(x.abs() < DEGENERATE * x.abs().amax(0, keepdim=True), 0.0, x)


def calibrate_markov_scale(
    w1: torch.Tensor,
    w2: torch.Tensor,
    streams: list[list[int]],
    seed: int,
    tokenizer_vocab: int,
    target: float = TARGET_TOP1,
) -> tuple[float, float]:
    """Scale ``alpha`` of the Markov tables such that the mean top-1 probability of
    ``alpha * w2 . w1[prev] + U`` over corpus transitions is ``target``, with U modelled as
    iid N(0, U_STD^2) per vocab entry.  Padding ids (>= tokenizer_vocab) are left out: their
    bias column rules them out.  Returns (alpha, the achieved mean top-1)."""
    gen = torch.Generator().manual_seed(seed + 29)
    prev = torch.tensor([t for ids in streams for t in ids[:-1]], dtype=torch.int64)
    pick = torch.randint(0, prev.numel(), (min(CALIBRATION_SAMPLES, prev.numel()),), generator=gen)
    bias = w1[prev[pick]] @ w2[:tokenizer_vocab].T  # [n, V_tokenizer]
    noise = torch.randn(bias.shape, generator=gen, dtype=torch.float64) * U_STD

    def top1(alpha: float) -> float:
        return float(torch.softmax(alpha * bias + noise, -1).amax(-1).mean())

    lo, hi = 0.01, 50.0
    for _ in range(24):  # log-bisection to a ratio of 1.0004; top-1 grows with alpha
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if top1(mid) < target else (lo, mid)
    alpha = math.sqrt(lo * hi)
    return alpha, top1(alpha)
