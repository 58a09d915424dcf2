"""Common random numbers for sampled rollouts (docs/eval-drift.md), on the model's own sampler
(``qstream.arch.markov.sampling_probs`` and ``sample``): the nucleus, the exponential race
drawing exactly from the distribution, identical draws for identical models, and close models
differing no more often than the race coupling's bound."""

from __future__ import annotations

import math

import torch

from qstream.arch.dspark_mla import PRESETS
from qstream.arch.markov import sample, sampling_probs
from qstream.eval.batches import race_noise


def _logits(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def _race(n: int, v: int, seed: int) -> torch.Tensor:
    return torch.empty(n, v).exponential_(generator=torch.Generator().manual_seed(seed))


def test_nucleus_is_the_smallest_prefix_reaching_top_p():
    logits = _logits([0.1, 0.2, 0.3, 0.4])
    kept = lambda top_p: (sampling_probs(logits, top_p=top_p) > 0).tolist()  # noqa: E731
    assert kept(0.65) == [False, False, True, True]  # 0.4 + 0.3 reaches 0.65
    assert kept(0.35) == [False, False, False, True]
    assert kept(0.95) == [True, True, True, True]
    assert kept(1e-9) == [False, False, False, True]  # the top token always survives


def test_the_race_draws_from_the_truncated_distribution():
    # n independent draws: every token's count within 5 binomial standard deviations of n·p
    # (a false alarm has probability ~1e-6 per token), and nothing outside the nucleus
    gen = torch.Generator().manual_seed(0)
    probs = sampling_probs(torch.randn(40, generator=gen) * 2, temperature=0.7, top_p=0.9)
    n = 200_000
    counts = torch.bincount(sample(probs.expand(n, -1), _race(n, 40, 1)), minlength=40).double()
    p = probs.double()
    sigma = (n * p * (1 - p)).sqrt()
    assert ((counts - n * p).abs() <= 5 * sigma + 1e-9).all(), (counts, n * p)
    assert counts[probs == 0].sum().item() == 0


def test_identical_models_on_common_random_numbers_draw_identical_tokens():
    # Two models with the same distribution, one holding its vocabulary in another order (its
    # noise permuted alike), draw the same token on every shared race: the draw depends on the
    # distribution and the race alone.  An inverse-CDF draw, exact in distribution too, would
    # depend on the order and fail here.
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 7, 1000, generator=gen)
    race = torch.empty(64, 7, 1000).exponential_(generator=gen)
    perm = torch.randperm(1000, generator=gen)
    drawn = sample(sampling_probs(logits), race)
    drawn_permuted = sample(sampling_probs(logits[..., perm]), race[..., perm])
    assert torch.equal(perm[drawn_permuted], drawn)


def test_close_models_disagree_within_the_coupling_bound():
    # the exponential race couples p and q with P(draws differ) <= 2·TV/(1+TV); on n shared
    # races the mismatch count stays below n times that plus 5 binomial standard deviations
    gen = torch.Generator().manual_seed(2)
    ref = torch.randn(200, generator=gen) * 3
    var = ref + 0.05 * torch.randn(200, generator=gen)
    p, q = sampling_probs(ref, top_p=1.0), sampling_probs(var, top_p=1.0)
    tv = 0.5 * (p.double() - q.double()).abs().sum().item()
    n = 100_000
    race = _race(n, 200, 3)
    differ = (sample(p.expand(n, -1), race) != sample(q.expand(n, -1), race)).sum().item()
    bound = 2 * tv / (1 + tv)
    assert tv > 0.005 and differ > 0  # the models do differ
    assert differ <= n * bound + 5 * math.sqrt(n * bound), (differ, n * bound)


def test_race_noise_is_exp1_and_never_zero():
    # eval-drift's per-batch race, -log(U): P(X > x) = exp(-x) (binomial 5-sigma bands over
    # 1.1 M draws), no race of 0 (a token that could not lose), deterministic per batch
    noise = race_noise(3, 160, PRESETS["tiny"], seed=0)
    assert noise.dtype == torch.float32 and bool((noise > 0).all())
    n = noise.numel()
    for x in (0.01, 0.5, 1.0, 3.0, 8.0):
        p = math.exp(-x)
        assert abs(float((noise > x).double().mean()) - p) < 5 * math.sqrt(p * (1 - p) / n)
    assert torch.equal(noise, race_noise(3, 160, PRESETS["tiny"], seed=0))
    assert not torch.equal(noise, race_noise(4, 160, PRESETS["tiny"], seed=0))
