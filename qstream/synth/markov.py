"""The Markov head of a synthetic draft from corpus statistics (docs/model.md, "Synthetic
checkpoint layout"): bigram log-probabilities, their low-rank markov_w1 / markov_w2 factors and
the scale that calibrates the head's top-1.  Memory stays linear in the vocabulary (docs/model.md,
"A draft for a Hugging Face target"): the [V, V] table is never formed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TARGET_TOP1 = 0.55  # the real U is not iid: measured top-1 on GSM8K lands ~0.07 above this
CALIBRATION_SAMPLES = 4096  # corpus transitions used to set the Markov scale (+-0.01 top-1)
BIGRAM_FLOOR = 0.03  # best rank-16 top-1 accuracy on GSM8K among 1e-4 .. 0.1 (12.8%)
DEGENERATE = 1e-9  # singular values closer than this (relative to the largest) are one eigenspace
SNAP_BITS = 20  # bits kept below a factor column's largest entry (_flush)
U_STD = 1.5  # nats: per-vocab spread of the network logits U (as synth's lm_head gives it)
# most calibration logits [samples, V] held at once (128 MB in float64)
CALIBRATION_LOGITS = 1 << 24
F64 = torch.float64  # every statistic: the same bytes on every CPU (qstream/synth/draft.py)


@dataclass(frozen=True)
class Bigrams:
    """``L = log P(next | prev)`` [V, V], add-one-unigram smoothed and floored at BIGRAM_FLOOR
    (so the low-rank fit spends its rank on likely continuations), held as
    ``log(BIGRAM_FLOOR) + S``.  Only a pair seen in the corpus, or a next token whose unigram
    probability alone passes the floor (at most 1/BIGRAM_FLOOR of them: the dense columns),
    rises above the floor, so S is a sparse part and a [V, D] block."""

    sparse: torch.Tensor  # S outside the dense columns, COO [V, V]
    sparse_t: torch.Tensor  # its transpose, COO [V, V]
    dense: torch.Tensor  # S in the dense columns [V, D]
    columns: torch.Tensor  # the dense columns' token ids [D]
    prev_counts: torch.Tensor  # how often each token is followed by another [V]
    floor: float  # log(BIGRAM_FLOOR)

    @classmethod
    def count(cls, streams: list[list[int]], vocab: int) -> Bigrams:
        seqs = [torch.tensor(ids, dtype=torch.int64) for ids in streams]
        pairs = torch.cat([t[:-1] * vocab + t[1:] for t in seqs if t.numel() > 1])
        keys, seen = torch.unique(pairs, return_counts=True)  # sorted pair ids
        prev, nxt, counts = keys // vocab, keys % vocab, seen.to(F64)
        unigram = torch.bincount(torch.cat(seqs), minlength=vocab).to(F64)
        p_uni = (unigram + 0.5) / (unigram.sum() + 0.5 * vocab)
        prev_counts = torch.zeros(vocab, dtype=F64).index_add_(0, prev, counts)
        floor = math.log(BIGRAM_FLOOR)
        columns = torch.nonzero(p_uni > BIGRAM_FLOOR).flatten()
        in_dense = torch.isin(nxt, columns)
        block = torch.zeros(vocab, columns.numel(), dtype=F64)  # the counts there
        block[prev[in_dense], torch.searchsorted(columns, nxt[in_dense])] = counts[in_dense]
        p = (block + p_uni[columns]) / (prev_counts[:, None] + 1.0)
        dense = torch.where(p > BIGRAM_FLOOR, p.log() - floor, 0.0)
        prev, nxt, counts = prev[~in_dense], nxt[~in_dense], counts[~in_dense]
        p = (counts + p_uni[nxt]) / (prev_counts[prev] + 1.0)
        keep = p > BIGRAM_FLOOR
        index, values = torch.stack([prev[keep], nxt[keep]]), p[keep].log() - floor
        sparse = torch.sparse_coo_tensor(index, values, (vocab, vocab), check_invariants=True)
        return cls(sparse.coalesce(), sparse.t().coalesce(), dense, columns, prev_counts, floor)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return self.floor * x.sum(0) + self.sparse @ x + self.dense @ x[self.columns]

    def t_mm(self, y: torch.Tensor) -> torch.Tensor:
        out = self.floor * y.sum(0) + self.sparse_t @ y
        return out.index_add_(0, self.columns, self.dense.T @ y)


def _svd_lowrank(product, product_t, n: int, q: int, niter: int):
    """``torch.svd_lowrank(A, q, niter)`` for a square [n, n] A given by ``product(x) = A @ x``
    and ``product_t(y) = Aᵀ @ y``: Halko et al. 2009, Algorithm 5.1, step by step as
    torch/_lowrank.py runs it (the same draws from torch's global generator)."""
    Q = torch.linalg.qr(product(torch.randn(n, q, dtype=F64))).Q
    for _ in range(niter):
        Q = torch.linalg.qr(product_t(Q)).Q
        Q = torch.linalg.qr(product(Q)).Q
    U, S, Vh = torch.linalg.svd(product_t(Q).mT, full_matrices=False)  # of Qᵀ A
    return Q @ U, S, Vh.mT


def markov_tables(
    bigrams: Bigrams, vocab: int, rank: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """markov_w1, markov_w2 [vocab, rank] with ``w2 @ w1[a]`` ~ row-centred ``L[a]``.
    Column rank-1 is a bias column (w1 = 1; w2 = the count-weighted mean next-token
    log-probability, and a large negative value for padding ids beyond the tokenizer); the
    other rank-1 columns are an SVD of the rest weighted by how often each prev token occurs
    (frequent contexts get the rank: +50% top-1 accuracy at rank 16 on GSM8K)."""
    vt = bigrams.prev_counts.numel()
    weight = (bigrams.prev_counts + 1.0)[:, None]  # [vt, 1]
    row_mean = bigrams.mm(torch.ones(vt, 1, dtype=F64)) / vt  # [vt, 1]
    col_mean = (bigrams.t_mm(weight) - weight.T @ row_mean).T / weight.sum()  # [1, vt]

    def product(x: torch.Tensor) -> torch.Tensor:  # A x, A = (L - row_mean - col_mean) √weight
        return (bigrams.mm(x) - row_mean * x.sum(0) - col_mean @ x) * weight.sqrt()

    def product_t(y: torch.Tensor) -> torch.Tensor:  # Aᵀ y
        z = y * weight.sqrt()
        return bigrams.t_mm(z) - row_mean.T @ z - col_mean.T * z.sum(0)

    with torch.random.fork_rng():
        torch.manual_seed(seed)  # float64: the same factors on every CPU (F64)
        u, s, v = _svd_lowrank(product, product_t, vt, q=min(rank - 1 + 16, vt), niter=6)
    u, v = _canonical(u, s, v)
    root = s[: rank - 1].sqrt()
    gen = torch.Generator().manual_seed(seed + 17)
    w1 = torch.randn(vocab, rank, generator=gen, dtype=torch.float64) * 0.1
    w2 = torch.randn(vocab, rank, generator=gen, dtype=torch.float64) * 0.1
    w1[:vt, : rank - 1] = u[:, : rank - 1] * root / weight.sqrt()
    w2[:vt, : rank - 1] = v[:, : rank - 1] * root
    w1[:, rank - 1] = 1.0
    w2[:vt, rank - 1] = col_mean[0]
    w2[vt:, rank - 1] = -30.0  # padding ids are never predicted
    return w1, w2


def _canonical(
    u: torch.Tensor, s: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Singular vectors fixed by the matrix alone: where singular values repeat (which rotation
    LAPACK returns follows the thread count), each eigenspace is rotated onto the eigenvectors of
    diag(0..n-1) restricted to it; every sign is set by a fixed generic vector (the largest
    entry ties for structured vectors such as (e_a - e_b)/sqrt(2))."""
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
    """Each entry snapped to a grid of 2^-SNAP_BITS of its column's largest power of two: LAPACK's
    factors differ between CPUs by ~1e-14 of that entry (MKL on AMD EPYC against Intel), which
    bf16 keeps in small entries; on the grid noise moves about one entry in 1e8."""
    top = torch.floor(torch.log2(x.abs().amax(0, keepdim=True).clamp(min=1e-300)))
    step = torch.pow(2.0, top - SNAP_BITS)
    return torch.round(x / step) * step + 0.0  # + 0.0: a noise entry's sign would stay on -0.0


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
    count = min(CALIBRATION_SAMPLES, CALIBRATION_LOGITS // tokenizer_vocab, prev.numel())
    pick = torch.randint(0, prev.numel(), (count,), generator=gen)
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
