"""Verification rules (qstream/eval/acceptance.py): self-verification accepts
everything, block verification is never worse than token-wise in expectation, greedy drafting
reduces both to prefix matching, the samplers' expectation (tests/verification_samplers.py)
equals the closed form, and both samplers emit the verifier's distribution (chi-square on a small vocabulary).  The same for the modes vLLM serves
beside them: a greedy (one-hot) draft against a sampling verifier, and adaptive verification's
trimmed drafts (exact enumeration, Monte Carlo, chi-square)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from verification_samplers import Verified, verify_block, verify_token_wise, verify_truncated

from qstream.eval.acceptance import (
    accept_probabilities,
    admitted_drafts,
    greedy_accepts,
    greedy_draft_probabilities,
    greedy_draft_stream_weights,
    request_batches,
    stream_weights,
    token_probs,
    truncated,
)

# The chi-square tests reject at this p-value.  With a fixed seed they are deterministic; a correct
# sampler would fail for about 1 seed in 1000, a wrong one (the negative control) fails by far.
CHI2_ALPHA = 1e-3
# Monte Carlo means are compared with the closed form within this many standard errors (a
# two-sided 5-sigma band: about 6e-7 false alarms for a correct implementation).
SIGMAS = 5.0
# The rules by vLLM's rejection_sample_method: acceptance.py's functions take ``block``.
BLOCK = {"standard": False, "block": True}


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


def _draft_expected_emitted(p, q, draft, rule, m=None):
    """E[τ] + 1 for one draft verified as a block of its first ``m`` tokens (default: all), by
    the sampler's own law of τ (block: the h_k and the last-pass rule; token-wise: first
    rejection)."""
    m = len(draft) if m is None else m
    r = [float(p[draft[:k]][draft[k]] / q[draft[:k]][draft[k]]) for k in range(m)]
    if rule == "standard":
        return 1 + sum(math.prod(min(1.0, x) for x in r[:k]) for k in range(1, m + 1))
    P = [1.0]
    for x in r:
        P.append(min(1.0, P[-1] * x))
    h = []
    for k in range(1, m):
        mass = float((P[k] * p[draft[:k]] - q[draft[:k]]).clamp(min=0).sum())
        denom = mass + 1 - P[k]
        h.append(mass / denom if denom > 0 else 1.0)
    h.append(P[m] if m else 0.0)
    return 1 + sum(k * h[k - 1] * math.prod(1 - x for x in h[k:m]) for k in range(1, m + 1))


def _draft_probability(q, draft):
    return math.prod(float(q[draft[:k]][draft[k]]) for k in range(len(draft)))


def _exact_expected_emitted(p, q, V, B, rule):
    """E[τ] + 1 by enumerating every draft, weighted by the draft probability."""
    total = 0.0
    for draft in itertools.product(range(V), repeat=B):
        prob = _draft_probability(q, draft)
        if prob > 0:
            total += prob * _draft_expected_emitted(p, q, draft, rule)
    return total


# small verifier/draft problems, enumerable exactly: vocabulary V, block B, a share of
# zero-probability tokens
SMALL_PROBLEMS = dict(
    seed=st.integers(0, 2**31 - 1),
    V=st.integers(2, 4),
    B=st.integers(1, 3),
    sparsity=st.sampled_from([0.0, 0.3, 0.6]),
)


@settings(max_examples=25, deadline=None)
@given(**SMALL_PROBLEMS)
def test_block_never_accepts_fewer_than_token_wise_in_expectation(seed, V, B, sparsity):
    p, q = _random_tree(V, B, torch.Generator().manual_seed(seed), sparsity)
    token_wise = _exact_expected_emitted(p, q, V, B, "standard")
    block = _exact_expected_emitted(p, q, V, B, "block")
    assert block >= token_wise - 1e-12, (block, token_wise)
    # the closed form P(τ ≥ k | x_{≤k}) averaged over drafts gives the same expectations
    for rule, exact in (("standard", token_wise), ("block", block)):
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
            closed += float(qs.prod()) * (
                1 + float(accept_probabilities(ps, qs, BLOCK[rule]).sum())
            )
        assert closed == pytest.approx(exact, rel=1e-9, abs=1e-12)


def test_closed_form_block_is_never_below_token_wise_per_draft():
    gen = torch.Generator().manual_seed(0)
    p, q = torch.rand(4096, 7, generator=gen), torch.rand(4096, 7, generator=gen)
    p[p < 0.1] = 0
    assert bool((accept_probabilities(p, q, True) >= accept_probabilities(p, q, False)).all())


def test_verifier_verifying_itself_accepts_every_token():
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(64, 8, 16, generator=gen), dim=-1)
    draft = torch.multinomial(probs[:, :7].flatten(0, 1), 1, generator=gen).view(64, 7)
    tok = token_probs(probs[:, :7], draft)
    for rule in ("standard", "block"):
        assert bool((accept_probabilities(tok, tok, BLOCK[rule]) == 1).all())
        assert bool((stream_weights(tok, tok, BLOCK[rule]) == 1).all())
    for verify in (verify_token_wise, verify_block):
        out = verify(draft, probs, probs[:, :7], gen)
        assert bool((out.accepted == 7).all())
        assert torch.equal(out.tokens[:, :7], draft)


def _top1_and_a_draft(seed: int, n: int = 512, B: int = 5, V: int = 6):
    """A verifier's argmax path [n, B] and a draft that follows it 70% of the time, with the
    verifier's one-hot distributions and the generator, which tests go on drawing from."""
    gen = torch.Generator().manual_seed(seed)
    top1 = torch.randint(V, (n, B), generator=gen)
    draft = torch.where(
        torch.rand(n, B, generator=gen) < 0.7, top1, torch.randint(V, (n, B), generator=gen)
    )
    return top1, draft, torch.nn.functional.one_hot(top1, V).double(), gen


def test_greedy_drafting_reduces_both_rules_to_prefix_matching():
    n, V = 512, 6
    target_top1, draft, p, gen = _top1_and_a_draft(2, n=n, V=V)  # p: a greedy verifier
    q = torch.nn.functional.one_hot(draft, V).double()  # greedy drafter
    expected = greedy_accepts(draft, target_top1)
    for rule in ("standard", "block"):
        assert torch.equal(
            accept_probabilities(token_probs(p, draft), token_probs(q, draft), BLOCK[rule]),
            expected,
        )
    bonus = torch.nn.functional.one_hot(torch.randint(V, (n, 1), generator=gen), V).double()
    for verify in (verify_token_wise, verify_block):
        out = verify(draft, torch.cat((p, bonus), dim=1), q, gen)
        assert torch.equal(out.accepted, expected.sum(dim=1).long())


@pytest.mark.parametrize("verify, rule", [(verify_token_wise, "standard"), (verify_block, "block")])
def test_sampler_mean_equals_the_closed_form(verify, rule):
    gen = torch.Generator().manual_seed(3)
    n, B, V = 20000, 3, 5
    logits = torch.randn(1, B + 1, V, generator=gen, dtype=torch.float64) * 1.5
    p = torch.softmax(logits, -1).expand(n, -1, -1)
    q = torch.softmax(logits[:, :B] + torch.randn(1, B, V, generator=gen, dtype=torch.float64), -1)
    q = q.expand(n, -1, -1)
    draft = torch.multinomial(q.flatten(0, 1), 1, generator=gen).view(n, B)
    closed = accept_probabilities(
        token_probs(p[:, :B], draft), token_probs(q, draft), BLOCK[rule]
    ).sum(1)
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
    n, B = draft.shape
    bonus = torch.multinomial(p[:, B], 1, generator=gen)
    return Verified(torch.full((n,), B), torch.cat((draft, bonus), dim=1))


def _chi2_pvalue(verify, seed: int, drafter: str = "probabilistic") -> float:
    gen = torch.Generator().manual_seed(seed)
    V, B, L, n = 4, 3, 3, 30000
    P, Q = _markov(V, gen, 0.25), _markov(V, gen, 0.25)
    if drafter == "greedy":  # a deterministic drafter: its argmax, one-hot
        Q = torch.nn.functional.one_hot(Q.argmax(dim=1), V).double()
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


@pytest.mark.parametrize("verify", [verify_token_wise, verify_block], ids=["standard", "block"])
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
    for rule in ("standard", "block"):
        direct = accept_probabilities(probs(P, drafts), probs(Q, drafts), BLOCK[rule]).sum(1)
        weighted = stream_weights(probs(P, stream), probs(Q, stream), BLOCK[rule]).sum(1)
        se = math.sqrt(direct.var().item() / n + weighted.var().item() / n)
        assert abs(direct.mean().item() - weighted.mean().item()) < SIGMAS * se, (
            rule,
            direct.mean().item(),
            weighted.mean().item(),
            se,
        )


# --- Greedy drafting against a sampling verifier (vLLM's default draft_sample_method) ---------


def _one_hot_tree(q: dict, V: int) -> dict:
    """A greedy drafter: the argmax of each of ``q``'s distributions, one-hot."""
    return {pre: torch.nn.functional.one_hot(d.argmax(), V).double() for pre, d in q.items()}


def _greedy_draft(q: dict, B: int) -> tuple[int, ...]:
    draft: tuple[int, ...] = ()
    for _ in range(B):
        draft += (int(q[draft].argmax()),)
    return draft


@settings(max_examples=25, deadline=None)
@given(**SMALL_PROBLEMS)
def test_greedy_draft_closed_form_is_the_samplers_law_and_block_equals_token_wise(
    seed, V, B, sparsity
):
    p, q = _random_tree(V, B, torch.Generator().manual_seed(seed), sparsity)
    greedy = _one_hot_tree(q, V)
    draft = _greedy_draft(q, B)
    p_tok = torch.tensor([[float(p[draft[:k]][draft[k]]) for k in range(B)]], dtype=torch.float64)
    exact = {rule: _exact_expected_emitted(p, greedy, V, B, rule) for rule in ("standard", "block")}
    for rule, value in exact.items():
        closed = 1 + float(greedy_draft_probabilities(p_tok, BLOCK[rule]).sum())
        assert closed == pytest.approx(value, rel=1e-12, abs=1e-12), (rule, closed, value)
    # a one-hot draft leaves block verification nothing to gain: P_k = prod p_j(x_j) either way
    assert exact["block"] == pytest.approx(exact["standard"], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("verify, rule", [(verify_token_wise, "standard"), (verify_block, "block")])
def test_greedy_draft_sampler_mean_equals_the_closed_form(verify, rule):
    gen = torch.Generator().manual_seed(6)
    n, B, V = 20000, 3, 5
    logits = torch.randn(n, B + 1, V, generator=gen, dtype=torch.float64) * 1.5
    p = torch.softmax(logits, -1)
    # the drafter's argmax: the verifier's most likely token most of the time, not always
    draft = (logits[:, :B] + torch.randn(n, B, V, generator=gen, dtype=torch.float64)).argmax(-1)
    q = torch.nn.functional.one_hot(draft, V).double()
    closed = 1 + greedy_draft_probabilities(token_probs(p[:, :B], draft), BLOCK[rule]).sum(1)
    simulated = verify(draft, p, q, gen).accepted.double() + 1
    diff = simulated - closed  # mean 0 block by block: the closed form is exact given the draft
    se = math.sqrt(diff.var().item() / n)
    assert abs(diff.mean().item()) < SIGMAS * se, (simulated.mean().item(), closed.mean().item())


@pytest.mark.parametrize("verify", [verify_token_wise, verify_block], ids=["standard", "block"])
def test_greedy_draft_output_distribution_is_the_verifiers(verify):
    pvalue = _chi2_pvalue(verify, seed=11, drafter="greedy")
    assert pvalue > CHI2_ALPHA, f"chi-square p = {pvalue:.2e} <= {CHI2_ALPHA}"


def test_greedy_draft_against_a_one_hot_verifier_is_greedy_against_greedy():
    top1, draft, p, _ = _top1_and_a_draft(7)  # p: a sampling verifier as T -> 0
    expected = greedy_accepts(draft, top1)
    for rule in ("standard", "block"):
        assert torch.equal(greedy_draft_probabilities(token_probs(p, draft), BLOCK[rule]), expected)
        # on the target's stream: the stream is its argmax path, the weight the matched run
        stream_p = token_probs(p, top1)
        weights = greedy_draft_stream_weights(stream_p, draft == top1, BLOCK[rule])
        assert torch.equal(weights, expected)


def test_greedy_draft_stream_weights_are_unbiased():
    """The matched run of a greedy drafter on streams drawn from the verifier averages to the
    closed form on the drafter's own greedy path."""
    gen = torch.Generator().manual_seed(8)
    V, B, n = 4, 3, 40000
    P, Q = _markov(V, gen, 0.3), _markov(V, gen, 0.3)
    greedy = Q.argmax(dim=1)  # the drafter's argmax after each token
    stream = torch.empty(n, B, dtype=torch.long)
    prev = torch.zeros(n, dtype=torch.long)
    for k in range(B):
        stream[:, k] = torch.multinomial(P[prev], 1, generator=gen).squeeze(1)
        prev = stream[:, k]
    context = torch.cat((torch.zeros(n, 1, dtype=torch.long), stream[:, :-1]), dim=1)
    draft, prev = [], torch.tensor(0)
    for _ in range(B):
        prev = greedy[prev]
        draft.append(int(prev))
    draft_context = [0, *draft[:-1]]
    p_draft = torch.tensor([[float(P[c, x]) for c, x in zip(draft_context, draft)]])
    for rule in ("standard", "block"):
        direct = greedy_draft_probabilities(p_draft.double(), BLOCK[rule])[0]  # [B]
        weights = greedy_draft_stream_weights(
            P[context, stream], greedy[context] == stream, BLOCK[rule]
        )
        se = weights.std(dim=0) / math.sqrt(n)
        assert bool(((weights.mean(dim=0) - direct).abs() < SIGMAS * se + 1e-12).all()), (
            rule,
            weights.mean(dim=0),
            direct,
        )


# --- Adaptive verification: the budget's best slots, trimmed drafts -----------------------------


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    R=st.integers(1, 4),
    B=st.integers(1, 4),
    share=st.floats(0, 1),
)
def test_admitted_drafts_are_the_budgets_best_prefixes(seed, R, B, share):
    """Against brute force: of every split of the budget into per-request prefixes, the one
    with the largest total survival (unique without ties)."""
    gen = torch.Generator().manual_seed(seed)
    confidence = torch.rand(R, B, generator=gen)
    admitted = admitted_drafts(confidence, torch.zeros(R, dtype=torch.long), share)
    budget = math.floor(share * B * R + 0.5)
    survival = confidence.float().cumprod(dim=1).double()

    def total(m):
        return sum(float(survival[r, :k].sum()) for r, k in enumerate(m))

    splits = [m for m in itertools.product(range(B + 1), repeat=R) if sum(m) == budget]
    assert admitted.tolist() == list(max(splits, key=total))


def test_admitted_drafts_ties_go_to_the_earlier_block_and_position():
    # vLLM's topk breaks ties as it may; here the earlier block of the batch, then the earlier
    # position, so that a slot's admission reads only its own block's earlier scores
    confidence = torch.ones(3, 4)
    assert admitted_drafts(confidence, torch.zeros(3, dtype=torch.long), 0.5).tolist() == [4, 2, 0]


def test_adaptive_batches_are_a_seeded_shuffle_taken_requests_at_a_time():
    batch = request_batches(10, requests=4, seed=3)
    assert torch.equal(batch, request_batches(10, 4, seed=3))
    assert torch.bincount(batch).tolist() == [4, 4, 2]
    assert not torch.equal(batch, torch.arange(10) // 4)  # shuffled
    confidence = torch.rand(10, 7, generator=torch.Generator().manual_seed(0))
    admitted = admitted_drafts(confidence, batch, 0.5)
    for b, size in enumerate([4, 4, 2]):
        assert int(admitted[batch == b].sum()) == math.floor(0.5 * 7 * size + 0.5)


def _confidence_tree(V: int, B: int, gen: torch.Generator) -> dict:
    """c_k as the confidence head computes it: a function of the drafted tokens before k."""
    return {
        pre: float(torch.rand(1, generator=gen))
        for n in range(B)
        for pre in itertools.product(range(V), repeat=n)
    }


@pytest.mark.parametrize("draft_method", ["probabilistic", "greedy"])
@pytest.mark.parametrize("rule", ["standard", "block"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adaptive_closed_form_is_the_samplers_law(draft_method, rule, seed):
    """Two requests share a budget of 3 of their 6 drafted tokens: every pair of drafts
    enumerated, each request's first m tokens verified by the sampler's own law."""
    gen = torch.Generator().manual_seed(seed)
    V, B, R = 3, 3, 2
    trees = [_random_tree(V, B, gen, sparsity=0.3) for _ in range(R)]
    if draft_method == "greedy":
        trees = [(p, _one_hot_tree(q, V)) for p, q in trees]
    conf = [_confidence_tree(V, B, gen) for _ in range(R)]
    exact = closed = 0.0
    for drafts in itertools.product(itertools.product(range(V), repeat=B), repeat=R):
        prob = math.prod(_draft_probability(q, x) for (_, q), x in zip(trees, drafts))
        if prob == 0:
            continue
        c = torch.tensor([[conf[r][x[:k]] for k in range(B)] for r, x in enumerate(drafts)])
        admitted = admitted_drafts(c, torch.zeros(R, dtype=torch.long), 0.5)
        for (p, q), x, m in zip(trees, drafts, admitted.tolist()):
            exact += prob * _draft_expected_emitted(p, q, x, rule, m)
            p_tok = torch.tensor([[float(p[x[:k]][x[k]]) for k in range(B)]], dtype=torch.float64)
            q_tok = torch.tensor([[float(q[x[:k]][x[k]]) for k in range(B)]], dtype=torch.float64)
            accept = truncated(accept_probabilities(p_tok, q_tok, BLOCK[rule]), torch.tensor([m]))
            closed += prob * (1 + float(accept.sum()))
    assert closed == pytest.approx(exact, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("draft_method", ["probabilistic", "greedy"])
@pytest.mark.parametrize("verify, rule", [(verify_token_wise, "standard"), (verify_block, "block")])
def test_adaptive_sampler_mean_equals_the_closed_form(verify, rule, draft_method):
    gen = torch.Generator().manual_seed(9)
    n, B, V, R = 16000, 4, 5, 4
    logits = torch.randn(n, B + 1, V, generator=gen, dtype=torch.float64) * 1.5
    p = torch.softmax(logits, -1)
    q_logits = logits[:, :B] + torch.randn(n, B, V, generator=gen, dtype=torch.float64)
    if draft_method == "greedy":
        draft = q_logits.argmax(-1)
        q = torch.nn.functional.one_hot(draft, V).double()
    else:
        q = torch.softmax(q_logits, -1)
        draft = torch.multinomial(q.flatten(0, 1), 1, generator=gen).view(n, B)
    confidence = torch.rand(n, B, generator=gen)
    admitted = admitted_drafts(confidence, torch.arange(n) // R, 0.5)
    accept = accept_probabilities(token_probs(p[:, :B], draft), token_probs(q, draft), BLOCK[rule])
    closed = 1 + truncated(accept, admitted).sum(1)
    result = verify_truncated(verify, draft, p, q, admitted, gen)
    assert bool((result.accepted <= admitted).all())
    diff = result.accepted.double() + 1 - closed
    se = math.sqrt(diff.var().item() / n)
    assert abs(diff.mean().item()) < SIGMAS * se, (diff.mean().item(), se)


def _trimmed(verify, reads_own_token: bool = False):
    """Adaptive verification in the chi-square's decoding loop: requests in batches of 4, half
    their drafted tokens verified, ranked by confidences that read the drafted tokens before
    each position (``reads_own_token``: the token itself, which no confidence head does)."""
    gen = torch.Generator().manual_seed(12)
    C = 0.2 + 0.8 * torch.rand(4, generator=gen)  # a confidence per token read

    def run(draft, p, q, generator):
        n = draft.shape[0]
        read = draft if reads_own_token else torch.cat((draft[:, :1] * 0, draft[:, :-1]), 1)
        admitted = admitted_drafts(C[read], torch.arange(n) // 4, 0.5)
        return verify_truncated(verify, draft, p, q, admitted, generator)

    return run


@pytest.mark.parametrize("drafter", ["probabilistic", "greedy"])
@pytest.mark.parametrize("verify", [verify_token_wise, verify_block], ids=["standard", "block"])
def test_adaptive_output_distribution_is_the_verifiers(verify, drafter):
    pvalue = _chi2_pvalue(_trimmed(verify), seed=11, drafter=drafter)
    assert pvalue > CHI2_ALPHA, f"chi-square p = {pvalue:.2e} <= {CHI2_ALPHA}"


def test_chi_square_detects_trimming_that_reads_the_token_it_drops():
    pvalue = _chi2_pvalue(_trimmed(verify_token_wise, reads_own_token=True), seed=11)
    assert pvalue <= CHI2_ALPHA, f"negative control passed: p = {pvalue:.2e}"


def test_a_reduced_vocabulary_draft_is_accepted_as_its_mapped_distribution():
    """A draft over Vd = 5 ids mapped to target ids TO_TARGET, verified over V = 10 (top-k 6):
    the closed form on the draft's logits scattered into the target vocabulary (vLLM's layout,
    ``in_target_vocab``), averaged over every drafted block, is the direct computation on
    ``q`` built id by id: token-wise P(tau >= k) = prod_{j<=k} sum_x min(p_j(x), q_j(x)); a
    greedy draft's first token is accepted with p_1(its mapped argmax)."""
    from qstream.arch.markov import in_target_vocab, sampling_probs

    V, B, T, to_target = 10, 2, 0.8, torch.tensor([1, 4, 5, 8, 9])
    gen = torch.Generator().manual_seed(3)
    draft_logits = torch.randn(1, B, len(to_target), generator=gen) * 1.5  # [1, B, Vd]
    p = sampling_probs(torch.randn(1, B, V, generator=gen) * 1.5, T, top_k=6).double()[0]
    q_mapped = sampling_probs(in_target_vocab(draft_logits, to_target, V), T).double()[0]
    q_draft = torch.softmax(draft_logits[0].double() / T, -1)  # [B, Vd]
    q_direct = torch.zeros(B, V, dtype=torch.float64)
    for d, x in enumerate(to_target.tolist()):
        q_direct[:, x] = q_draft[:, d]
    # the mapped q is sampling_probs' float32 softmax, the direct one float64: a few float32 ulps
    rtol = 1e-6
    assert torch.allclose(q_mapped, q_direct, rtol=rtol, atol=0), (q_mapped - q_direct).abs().max()
    blocks = torch.tensor(list(itertools.product(to_target.tolist(), repeat=B)))  # [Vd^B, B]
    positions = torch.arange(B).expand_as(blocks)
    p_tok, q_tok = p[positions, blocks], q_mapped[positions, blocks]
    weight = q_tok.prod(dim=1, keepdim=True)  # P(the draft drafts the block)
    expected = (weight * accept_probabilities(p_tok, q_tok, block=False)).sum(dim=0)
    direct = torch.minimum(p, q_direct).sum(dim=-1).cumprod(dim=0)
    assert torch.allclose(expected, direct, rtol=rtol, atol=0), (expected, direct, rtol)
    greedy = to_target[draft_logits[0].argmax(-1)]  # the mapped argmax vLLM emits
    mapped_argmax = in_target_vocab(draft_logits, to_target, V)[0].argmax(-1)
    assert torch.equal(mapped_argmax, greedy)
    first = greedy_draft_probabilities(p[torch.arange(B), greedy][None], block=False)[0, 0]
    assert first == p[0, int(greedy[0])]
