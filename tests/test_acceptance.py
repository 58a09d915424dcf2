"""Verification rules (qstream/eval/acceptance.py): self-verification accepts everything, block
verification is never worse than token-wise in expectation, greedy drafting reduces both to
prefix matching, the samplers' expectation equals the closed form, and both samplers emit the
verifier's distribution (chi-square on a small vocabulary)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from qstream.eval.acceptance import (
    accept_probabilities,
    greedy_accepts,
    stream_weights,
    token_probs,
    verify_block,
    verify_token_wise,
)

# The chi-square tests reject at this p-value.  With a fixed seed they are deterministic; a correct
# sampler would fail for about 1 seed in 1000, a wrong one (the negative control) fails by far.
CHI2_ALPHA = 1e-3
# Monte Carlo means are compared with the closed form within this many standard errors (a
# two-sided 5-sigma band: about 6e-7 false alarms for a correct implementation).
SIGMAS = 5.0


def _random_tree(V: int, B: int, gen: torch.Generator, sparsity: float = 0.3):
    """Distributions p(·|prefix), q(·|prefix) for every prefix of length 0..B (p also at B): a
    dict prefix tuple -> [V] probability tensor; some entries zeroed (as top-p truncation does)."""

    def dist():
        w = torch.rand(V, generator=gen, dtype=torch.float64) ** 3
        w = torch.where(torch.rand(V, generator=gen) < sparsity, 0.0, w)
        w[torch.randint(V, (1,), generator=gen)] += 0.05  # never all zero
        return w / w.sum()

    p = {pre: dist() for n in range(B + 1) for pre in itertools.product(range(V), repeat=n)}
    q = {pre: dist() for n in range(B) for pre in itertools.product(range(V), repeat=n)}
    return p, q


def _exact_expected_emitted(p, q, V, B, rule):
    """E[τ] + 1 by enumerating every draft: the sampler's own law of τ (block: the h_k and the
    last-pass rule; token-wise: first rejection), weighted by the draft probability."""
    total = 0.0
    for draft in itertools.product(range(V), repeat=B):
        prob = math.prod(float(q[draft[:k]][draft[k]]) for k in range(B))
        if prob == 0:
            continue
        r = [float(p[draft[:k]][draft[k]] / q[draft[:k]][draft[k]]) for k in range(B)]
        if rule == "token_wise":
            expected = sum(math.prod(min(1.0, x) for x in r[:k]) for k in range(1, B + 1))
        else:
            P = [1.0]
            for x in r:
                P.append(min(1.0, P[-1] * x))
            h = []
            for k in range(1, B):
                mass = float((P[k] * p[draft[:k]] - q[draft[:k]]).clamp(min=0).sum())
                denom = mass + 1 - P[k]
                h.append(mass / denom if denom > 0 else 1.0)
            h.append(P[B])
            expected = sum(k * h[k - 1] * math.prod(1 - x for x in h[k:]) for k in range(1, B + 1))
        total += prob * (1 + expected)
    return total


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    V=st.integers(2, 4),
    B=st.integers(1, 3),
    sparsity=st.sampled_from([0.0, 0.3, 0.6]),
)
def test_block_never_accepts_fewer_than_token_wise_in_expectation(seed, V, B, sparsity):
    p, q = _random_tree(V, B, torch.Generator().manual_seed(seed), sparsity)
    token_wise = _exact_expected_emitted(p, q, V, B, "token_wise")
    block = _exact_expected_emitted(p, q, V, B, "block")
    assert block >= token_wise - 1e-12, (block, token_wise)
    # the closed form P(τ ≥ k | x_{≤k}) averaged over drafts gives the same expectations
    for rule, exact in (("token_wise", token_wise), ("block", block)):
        closed = 0.0
        for draft in itertools.product(range(V), repeat=B):
            qs = torch.tensor(
                [[float(q[draft[:k]][draft[k]]) for k in range(B)]], dtype=torch.float64
            )
            if float(qs.prod()) == 0:
                continue
            ps = torch.tensor(
                [[float(p[draft[:k]][draft[k]]) for k in range(B)]], dtype=torch.float64
            )
            closed += float(qs.prod()) * (1 + float(accept_probabilities(ps, qs, rule).sum()))
        assert closed == pytest.approx(exact, rel=1e-9, abs=1e-12)


def test_closed_form_block_is_never_below_token_wise_per_draft():
    gen = torch.Generator().manual_seed(0)
    p, q = torch.rand(4096, 7, generator=gen), torch.rand(4096, 7, generator=gen)
    p[p < 0.1] = 0
    assert bool(
        (accept_probabilities(p, q, "block") >= accept_probabilities(p, q, "token_wise")).all()
    )


def test_verifier_verifying_itself_accepts_every_token():
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(64, 8, 16, generator=gen), dim=-1)
    draft = torch.multinomial(probs[:, :7].flatten(0, 1), 1, generator=gen).view(64, 7)
    tok = token_probs(probs[:, :7], draft)
    for rule in ("token_wise", "block"):
        assert bool((accept_probabilities(tok, tok, rule) == 1).all())
        assert bool((stream_weights(tok, tok, rule) == 1).all())
    for verify in (verify_token_wise, verify_block):
        out = verify(draft, probs, probs[:, :7], gen)
        assert bool((out.accepted == 7).all())
        assert torch.equal(out.tokens[:, :7], draft)


def test_greedy_drafting_reduces_both_rules_to_prefix_matching():
    gen = torch.Generator().manual_seed(2)
    n, B, V = 512, 5, 6
    target_top1 = torch.randint(V, (n, B), generator=gen)
    draft = torch.where(
        torch.rand(n, B, generator=gen) < 0.7, target_top1, torch.randint(V, (n, B), generator=gen)
    )
    p = torch.nn.functional.one_hot(target_top1, V).double()  # greedy verifier: argmax one-hot
    q = torch.nn.functional.one_hot(draft, V).double()  # greedy drafter
    expected = greedy_accepts(draft, target_top1)
    for rule in ("token_wise", "block"):
        assert torch.equal(
            accept_probabilities(token_probs(p, draft), token_probs(q, draft), rule), expected
        )
    bonus = torch.nn.functional.one_hot(torch.randint(V, (n, 1), generator=gen), V).double()
    for verify in (verify_token_wise, verify_block):
        out = verify(draft, torch.cat((p, bonus), dim=1), q, gen)
        assert torch.equal(out.accepted, expected.sum(dim=1).long())


@pytest.mark.parametrize(
    "verify, rule", [(verify_token_wise, "token_wise"), (verify_block, "block")]
)
def test_sampler_mean_equals_the_closed_form(verify, rule):
    gen = torch.Generator().manual_seed(3)
    n, B, V = 20000, 3, 5
    logits = torch.randn(1, B + 1, V, generator=gen, dtype=torch.float64) * 1.5
    p = torch.softmax(logits, -1).expand(n, -1, -1)
    q = torch.softmax(logits[:, :B] + torch.randn(1, B, V, generator=gen, dtype=torch.float64), -1)
    q = q.expand(n, -1, -1)
    draft = torch.multinomial(q.flatten(0, 1), 1, generator=gen).view(n, B)
    closed = accept_probabilities(token_probs(p[:, :B], draft), token_probs(q, draft), rule).sum(1)
    simulated = verify(draft, p, q, gen).accepted.double()
    se = math.sqrt(simulated.var().item() / n)
    assert abs(simulated.mean().item() - closed.mean().item()) < SIGMAS * se, (
        simulated.mean().item(),
        closed.mean().item(),
        se,
    )


def _markov(V: int, gen: torch.Generator, sparsity: float):
    w = torch.rand(V, V, generator=gen, dtype=torch.float64) ** 2
    w = torch.where(torch.rand(V, V, generator=gen) < sparsity, 0.0, w)
    w[torch.arange(V), torch.randint(V, (V,), generator=gen)] += 0.1
    return w / w.sum(dim=1, keepdim=True)


def _generate(verify, P, Q, start: int, length: int, n: int, B: int, gen) -> torch.Tensor:
    """Speculative decoding from Markov chains P (verifier) and Q (drafter): rounds of B drafted
    tokens, each verified, until every one of n runs has emitted ``length`` tokens."""
    out = torch.full((n, length + B + 1), -1)
    filled = torch.zeros(n, dtype=torch.long)
    last = torch.full((n,), start)
    rows = torch.arange(n)
    while bool((filled < length).any()):
        prev, draft = last, torch.empty(n, B, dtype=torch.long)
        for k in range(B):
            draft[:, k] = torch.multinomial(Q[prev], 1, generator=gen).squeeze(1)
            prev = draft[:, k]
        context = torch.cat((last[:, None], draft), dim=1)  # the token each position conditions on
        result = verify(draft, P[context], Q[context[:, :B]], gen)
        emitted = result.accepted + 1
        for j in range(B + 1):
            write = (j < emitted) & (filled + j < out.shape[1])
            out[rows[write], (filled + j)[write]] = result.tokens[write, j]
        last = result.tokens[rows, result.accepted]
        filled = filled + emitted
    return out[:, :length]


def _accept_all(draft, p, q, gen):
    """Negative control: a 'verifier' that accepts every draft (emits the drafter's law)."""
    from qstream.eval.acceptance import Verified

    n, B = draft.shape
    bonus = torch.multinomial(p[:, B], 1, generator=gen)
    return Verified(torch.full((n,), B), torch.cat((draft, bonus), dim=1))


def _chi2_pvalue(verify, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    V, B, L, n = 4, 3, 3, 30000
    P, Q = _markov(V, gen, 0.25), _markov(V, gen, 0.25)
    start = 0
    seqs = _generate(verify, P, Q, start, L, n, B, gen)
    codes = (seqs * torch.tensor([V * V, V, 1])).sum(dim=1)
    observed = torch.bincount(codes, minlength=V**L).double()
    expected = (
        torch.tensor(
            [
                float(P[start, a] * P[a, b] * P[b, c])
                for a, b, c in itertools.product(range(V), repeat=L)
            ]
        )
        * n
    )
    impossible = expected == 0
    if bool((observed[impossible] > 0).any()):
        return 0.0  # the sampler emitted a sequence the verifier cannot produce
    return float(stats.chisquare(observed[~impossible], expected[~impossible]).pvalue)


@pytest.mark.parametrize("verify", [verify_token_wise, verify_block], ids=["token_wise", "block"])
def test_output_distribution_is_the_verifiers(verify):
    pvalue = _chi2_pvalue(verify, seed=11)
    assert pvalue > CHI2_ALPHA, f"chi-square p = {pvalue:.2e} <= {CHI2_ALPHA}"


def test_chi_square_detects_a_sampler_that_is_not_the_verifiers():
    pvalue = _chi2_pvalue(_accept_all, seed=11)
    assert pvalue <= CHI2_ALPHA, f"negative control passed: p = {pvalue:.2e}"


def test_stream_weights_are_unbiased_for_the_expected_acceptance():
    """Averaging the importance weights over streams drawn from the verifier gives the same
    P(τ ≥ k) as averaging the closed form over drafts drawn from the drafter."""
    gen = torch.Generator().manual_seed(5)
    V, B, n = 4, 3, 40000
    P, Q = _markov(V, gen, 0.3), _markov(V, gen, 0.3)

    def chain(M):
        prev, toks = torch.zeros(n, dtype=torch.long), torch.empty(n, B, dtype=torch.long)
        for k in range(B):
            toks[:, k] = torch.multinomial(M[prev], 1, generator=gen).squeeze(1)
            prev = toks[:, k]
        return toks

    def probs(M, toks):
        context = torch.cat((torch.zeros(n, 1, dtype=torch.long), toks[:, :-1]), dim=1)
        return M[context, toks]

    drafts, stream = chain(Q), chain(P)
    for rule in ("token_wise", "block"):
        direct = accept_probabilities(probs(P, drafts), probs(Q, drafts), rule).sum(1)
        weighted = stream_weights(probs(P, stream), probs(Q, stream), rule).sum(1)
        se = math.sqrt(direct.var().item() / n + weighted.var().item() / n)
        assert abs(direct.mean().item() - weighted.mean().item()) < SIGMAS * se, (
            rule,
            direct.mean().item(),
            weighted.mean().item(),
            se,
        )
