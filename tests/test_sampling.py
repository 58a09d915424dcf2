"""Common random numbers for sampled rollouts (DESIGN.md section 6), on the model's own sampler
(``qstream.model.dspark.sampling_probs`` and ``sample``): exact draws at chosen uniforms, the
nucleus, the sampled distribution on a uniform grid, identical draws for identical models, and
close models differing only where u falls between their CDFs."""

from __future__ import annotations

import torch

from qstream.model.dspark import sample, sampling_probs


def _logits(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def test_draws_at_chosen_uniforms():
    # CDF in id order: 0.1, 0.3, 0.6, 1.0; uniforms away from the edges
    probs = sampling_probs(_logits([0.1, 0.2, 0.3, 0.4]).expand(4, 4), top_p=1.0)
    assert sample(probs, torch.tensor([0.05, 0.15, 0.35, 0.95])).tolist() == [0, 1, 2, 3]


def test_nucleus_is_the_smallest_prefix_reaching_top_p():
    logits = _logits([0.1, 0.2, 0.3, 0.4])
    kept = lambda top_p: (sampling_probs(logits, top_p=top_p) > 0).tolist()  # noqa: E731
    assert kept(0.65) == [False, False, True, True]  # 0.4 + 0.3 reaches 0.65
    assert kept(0.35) == [False, False, False, True]
    assert kept(0.95) == [True, True, True, True]
    assert kept(1e-9) == [False, False, False, True]  # the top token always survives


def test_grid_of_uniforms_reproduces_the_truncated_distribution():
    # n evenly spaced uniforms: each token's count is within one point of n times its renormalised
    # nucleus probability (an interval of length L holds n·L ± 1 grid points); float32 CDF rounding
    # (~1e-7 relative) moves an edge by ~0.002 points at this n
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, generator=gen) * 2
    n = 20000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    probs = sampling_probs(logits, temperature=0.7, top_p=0.9)
    tokens = sample(probs.expand(n, -1), u)
    counts = torch.bincount(tokens, minlength=40).double()
    assert (counts - n * probs.double()).abs().max().item() <= 1.0
    assert counts[probs == 0].sum().item() == 0


def test_identical_models_on_common_random_numbers_draw_identical_tokens():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 7, 1000, generator=gen)
    u = torch.rand(64, 7, generator=gen)
    assert torch.equal(sample(sampling_probs(logits), u), sample(sampling_probs(logits.clone()), u))


def test_close_models_differ_only_between_their_cdfs():
    # on common u the draws differ only where u falls between the two id-order CDFs, so the number
    # of differing draws on a grid is at most n·Σ_i |F_p(i) − F_q(i)| plus one point per CDF edge
    gen = torch.Generator().manual_seed(2)
    ref = torch.randn(200, generator=gen) * 3
    var = ref + 1e-3 * torch.randn(200, generator=gen)
    n = 20000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    p, q = sampling_probs(ref), sampling_probs(var)
    differ = (sample(p.expand(n, -1), u) != sample(q.expand(n, -1), u)).sum().item()
    bound = n * (p.double().cumsum(-1) - q.double().cumsum(-1)).abs().sum().item() + 200
    assert differ <= bound, (differ, bound)


def test_a_uniform_just_below_one_never_draws_outside_the_nucleus():
    probs = sampling_probs(torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log(), top_p=0.65)
    assert probs[0, 2:].tolist() == [0.0, 0.0]
    u = torch.tensor([0.99999999], dtype=torch.float64)  # rounds to 1.0 in float32
    assert sample(probs, u).tolist() == [1]
