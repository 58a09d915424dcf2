"""Coverage of the 95% intervals by simulation on models whose true value is known
(qstream/eval/estimates.py): each must cover at least 90% of the time.  Every test also shows
the interval it replaced under-covering on the same data, so a test can fail."""

import math

import numpy as np
import torch

from qstream.eval.acceptance import summarise
from qstream.eval.estimates import pearson_r, pooled_proportion, proportion, wilson_interval
from qstream.eval.metrics import rollout_metrics

B = 7
REPLICATES = 200  # coverage ± ~1.5% (binomial sd at 0.95): 90% is 3 sd below nominal
LEAST = 0.90


def _covered(lo: float, hi: float, truth: float) -> bool:
    return lo <= truth <= hi


def test_wilson_covers_a_proportion_near_one():
    gen = torch.Generator().manual_seed(0)
    truth, n = 0.98, 60
    hits = [proportion(torch.rand(n, generator=gen) < truth) for _ in range(REPLICATES)]
    coverage = sum(_covered(e.lo, e.hi, truth) for e in hits) / REPLICATES
    assert coverage >= LEAST, coverage


def _clustered_hits(rng: np.random.Generator, n: int, truth: float, spread: float) -> torch.Tensor:
    """[n, B] 0/1 with per-block probability Beta(truth·s, (1 − truth)·s), s = 1/spread:
    correlated within a block, mean ``truth``."""
    p = rng.beta(truth / spread, (1 - truth) / spread, size=(n, 1))
    return torch.from_numpy(rng.random((n, B)) < p)


def test_pooled_proportion_covers_clustered_positions_where_plain_wilson_does_not():
    rng = np.random.default_rng(1)
    truth, covered, naive = 0.3, 0, 0
    for _ in range(REPLICATES):
        hits = _clustered_hits(rng, 100, truth, spread=0.5)
        e = pooled_proportion(hits)
        covered += _covered(e.lo, e.hi, truth)
        naive += _covered(*wilson_interval(e.value, hits.numel()), truth)
    assert covered / REPLICATES >= LEAST, covered / REPLICATES
    assert naive / REPLICATES < LEAST, naive / REPLICATES  # tokens as independent trials


def _prefix_tokens(gen: torch.Generator, n: int, stop: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollouts that part at each position with probability ``stop`` (a geometric matched
    prefix, capped at B): mean matched prefix Σ_k (1 − stop)^(k+1)."""
    ref = torch.zeros(n, B, dtype=torch.int64)
    var = torch.where(torch.rand(n, B, generator=gen) < stop, 1, 0)
    return ref, var


def test_matched_prefix_and_greedy_acceptance_cover_where_student_t_collapses():
    gen = torch.Generator().manual_seed(2)
    stop = 0.005  # near-perfect agreement: most runs see every block match
    truth = sum((1 - stop) ** (k + 1) for k in range(B))
    covered = accepted = collapsed = 0
    for _ in range(REPLICATES):
        ref, var = _prefix_tokens(gen, 64, stop)
        e = rollout_metrics(ref, var).ceiling
        covered += _covered(e.lo, e.hi, truth)
        outcomes = ((ref != var).cumsum(dim=1) == 0).double()  # greedy accepts, 0/1
        g = summarise(outcomes, outcomes=True).emitted
        accepted += _covered(g.lo, g.hi, 1 + truth)
        t = summarise(outcomes).emitted  # Student t over blocks, the interval it replaced
        collapsed += _covered(t.lo, t.hi, 1 + truth)
    assert covered / REPLICATES >= LEAST and accepted / REPLICATES >= LEAST, (covered, accepted)
    assert collapsed / REPLICATES < LEAST, collapsed / REPLICATES


def _block_pairs(gen: torch.Generator, n: int, rho: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, B] pairs: a shared per-block effect (variance 4) plus per-token noise (variance 1),
    each pair-correlated by ``rho``; the pooled correlation is ``rho``."""

    def correlated(shape, scale):
        a, b = torch.randn(2, *shape, generator=gen, dtype=torch.float64)
        return scale * a, scale * (rho * a + math.sqrt(1 - rho**2) * b)

    bx, by = correlated((n, 1), 2.0)
    tx, ty = correlated((n, B), 1.0)
    return bx + tx, by + ty


def test_block_bootstrap_of_r_covers_where_fisher_z_does_not():
    gen = torch.Generator().manual_seed(3)
    rho, covered, fisher = 0.6, 0, 0
    for i in range(REPLICATES):
        x, y = _block_pairs(gen, 60, rho)
        e = pearson_r(x, y, resamples=300, seed=i)
        covered += _covered(e.lo, e.hi, rho)
        half = 1.959964 / math.sqrt(x.numel() - 3)  # tokens as independent pairs
        z = math.atanh(e.value)
        fisher += _covered(math.tanh(z - half), math.tanh(z + half), rho)
    assert covered / REPLICATES >= LEAST, covered / REPLICATES
    assert fisher / REPLICATES < LEAST, fisher / REPLICATES
