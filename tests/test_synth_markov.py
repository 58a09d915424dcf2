"""The Markov head's statistics without a [V, V] table (qstream/synth/markov.py): the bigram
table as a floor plus a sparse part equals the dense formula, and the randomized SVD over its
products is torch.svd_lowrank's, draw for draw."""

import torch

from qstream.synth.corpus import builtin_corpus, train_tokenizer
from qstream.synth.markov import BIGRAM_FLOOR, Bigrams, _svd_lowrank

# L = floor + (log p - floor) rounds twice where the dense formula rounds once: a few ulps of
# |log BIGRAM_FLOOR| = 3.5 (ulp 4.4e-16)
ROUNDING = 4e-15


def _dense_logprobs(streams, vocab):
    """The dense table as synth built it before (add-one-unigram smoothed, floored)."""
    seqs = [torch.tensor(ids, dtype=torch.int64) for ids in streams]
    pairs = torch.cat([t[:-1] * vocab + t[1:] for t in seqs if t.numel() > 1])
    counts = torch.bincount(pairs, minlength=vocab * vocab).view(vocab, vocab).double()
    unigram = torch.bincount(torch.cat(seqs), minlength=vocab).double()
    p_uni = (unigram + 0.5) / (unigram.sum() + 0.5 * vocab)
    p = (counts + p_uni) / (counts.sum(1, keepdim=True) + 1.0)
    return p.clamp(min=BIGRAM_FLOOR).log(), counts.sum(1)


def test_bigrams_are_the_dense_table():
    texts = builtin_corpus(n=200, seed=0)
    tok = train_tokenizer(texts, 300)
    streams = [e.ids for e in tok.encode_batch(texts)]
    vocab = tok.get_vocab_size()
    dense, prev_counts = _dense_logprobs(streams, vocab)
    bigrams = Bigrams.count(streams, vocab)
    assert bigrams.columns.numel() > 0  # the corpus has tokens above the floor on their own
    eye = torch.eye(vocab, dtype=torch.float64)
    torch.testing.assert_close(bigrams.mm(eye), dense, rtol=0, atol=ROUNDING)
    torch.testing.assert_close(bigrams.t_mm(eye), dense.T, rtol=0, atol=ROUNDING)
    assert torch.equal(bigrams.prev_counts, prev_counts)


# torch forms Qᵀ A as matmul(Q.mH, A); over products only (Aᵀ Q)ᵀ exists. The same sums, which
# BLAS may associate differently by CPU (AMD EPYC: 1.3e-15 on Qᵀ A, 6e-15 after the SVD; equal
# on the Intel machines before it): a few ulps of float64, five orders below a different draw
BLAS_ORDER = 1e-13


def test_svd_over_products_is_torch_svd_lowrank():
    """niter=0 and a flat spectrum: the result depends on the random start, so different
    draws (or steps) would show: another seed moves every factor by more than 0.1."""
    a = torch.randn(60, 60, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)
    want = torch.svd_lowrank(a, q=5, niter=0)
    torch.manual_seed(7)
    got = _svd_lowrank(lambda x: a @ x, lambda y: a.T @ y, 60, q=5, niter=0)
    torch.manual_seed(8)
    other = _svd_lowrank(lambda x: a @ x, lambda y: a.T @ y, 60, q=5, niter=0)
    for g, w, o in zip(got, want, other, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=BLAS_ORDER)
        assert (o - w).abs().max() > 0.1
