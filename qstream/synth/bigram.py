"""The synthetic draft's Markov head from corpus statistics (docs/model.md, "Synthetic
checkpoint layout"): bigram log-probabilities of the tokenized corpus, their low-rank
``markov_w1`` / ``markov_w2`` factors, and the scale that calibrates the head's top-1 accuracy."""

from __future__ import annotations

import math

import torch

TARGET_TOP1 = 0.55  # the real U is not iid: measured top-1 on GSM8K lands ~0.07 above this
CALIBRATION_SAMPLES = 4096  # corpus transitions used to set the Markov scale (+-0.01 top-1)
BIGRAM_FLOOR = 0.03  # best rank-16 top-1 accuracy on GSM8K among 1e-4 .. 0.1 (12.8%)
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
    return p.clamp(min=BIGRAM_FLOOR).log().float(), counts.sum(1).float()


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
        u, s, v = torch.svd_lowrank(
            (centred - col_mean) * weight.sqrt(), q=min(rank - 1 + 16, vt), niter=6
        )
    root = s[: rank - 1].sqrt()
    gen = torch.Generator().manual_seed(seed + 17)
    w1 = torch.randn(vocab, rank, generator=gen) * 0.1
    w2 = torch.randn(vocab, rank, generator=gen) * 0.1
    w1[:vt, : rank - 1] = u[:, : rank - 1] * root / weight.sqrt()
    w2[:vt, : rank - 1] = v[:, : rank - 1] * root
    w1[:, rank - 1] = 1.0
    w2[:vt, rank - 1] = col_mean
    w2[vt:, rank - 1] = -30.0  # padding ids are never predicted
    return w1, w2


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
    noise = torch.randn(bias.shape, generator=gen) * U_STD

    def top1(alpha: float) -> float:
        return float(torch.softmax(alpha * bias + noise, -1).amax(-1).mean())

    lo, hi = 0.01, 50.0
    for _ in range(24):  # log-bisection to a ratio of 1.0004; top-1 grows with alpha
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if top1(mid) < target else (lo, mid)
    alpha = math.sqrt(lo * hi)
    return alpha, top1(alpha)
