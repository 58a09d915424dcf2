"""Point estimates with 95% intervals (the ``Estimate`` of every results entry), and the
interval each kind of quantity gets (metrics.py defines the quantities):

* per-position proportions (greedy / seq / prefix agree[k]): Wilson score interval over blocks,
  which are independent; Wald collapses to zero width at 0 and 1, where bf16's agreement sits,
  and under-covers near them (Brown, Cai & DasGupta, Statistical Science 16(2), 2001).
* pooled proportions (flip rate, agreement over all positions, and B × them: the mean matched
  prefix and greedy acceptance): positions of one block share a context, so Wilson on Kish's
  effective sample size N / deff, deff = (cluster-robust variance of the ratio estimate over
  blocks) / (binomial variance), clamped to [1, m] for clusters of at most m positions; where no
  variance is seen (every outcome equal) deff = m: the blocks, not the tokens, are the trials.
* means of continuous quantities (1−TV[k], KL, sampled acceptance): Student-t interval over
  blocks (pooled over positions: over per-block means), clipped to the quantity's range.
* Pearson r: a percentile block bootstrap with a fixed seed; the Fisher-z interval, which treats
  a block's tokens as independent, was 2.6–3.6× too narrow on real runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from scipy import stats

# Two-sided 95% standard-normal quantile: scipy.stats.norm.ppf(0.975).
Z95 = 1.959963984540054


def json_number(x: float) -> float | None:
    """A float for JSON: NaN and infinities (no value, no interval) become None."""
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its 95% interval; ``n`` counts the observations it averages."""

    value: float
    lo: float
    hi: float
    n: int

    def to_json(self) -> dict:
        return {
            "value": json_number(self.value),
            "lo": json_number(self.lo),
            "hi": json_number(self.hi),
            "n": self.n,
        }


def wilson_interval(p_hat: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of ``p_hat`` over ``n`` (maybe effective, non-integer) trials; the
    bounds at ``p_hat`` 0 and 1 are exact."""
    if not n > 0:
        raise ValueError(f"a proportion needs n > 0 trials, got n={n}")
    z2n = z * z / n
    centre = (p_hat + z2n / 2) / (1 + z2n)
    half = z * math.sqrt(p_hat * (1 - p_hat) / n + z2n / (4 * n)) / (1 + z2n)
    lo = 0.0 if p_hat == 0 else max(0.0, centre - half)
    hi = 1.0 if p_hat == 1 else min(1.0, centre + half)
    return lo, hi


def proportion(hits: torch.Tensor) -> Estimate:
    """Share of True among independent trials, with its Wilson interval."""
    n = hits.numel()
    p = hits.sum().item() / n if n else math.nan
    return Estimate(p, *wilson_interval(p, n), n)


def per_position(hits: torch.Tensor) -> tuple[Estimate, ...]:
    """:func:`proportion` of each column (position) of ``[n, B]`` hits, over the blocks."""
    return tuple(proportion(hits[:, k]) for k in range(hits.shape[1]))


def pooled_proportion(hits: torch.Tensor, counted: torch.Tensor | None = None) -> Estimate:
    """Share of True over the ``counted`` positions (default: all) of ``[n, B]`` hits whose rows
    (blocks) are independent but whose positions within a row need not be: Wilson interval on
    Kish's effective sample size (module docstring)."""
    counted = torch.ones_like(hits, dtype=torch.bool) if counted is None else counted
    hits, m = (hits & counted).double().sum(dim=1), counted.double().sum(dim=1)  # [n] each
    total, n_blocks = m.sum().item(), hits.numel()
    if total == 0:
        raise ValueError("a proportion needs at least one counted position")
    p = hits.sum().item() / total
    binomial_var = p * (1 - p) / total
    largest = max(1.0, m.max().item())
    deff = largest  # the worst case when no variance is seen
    if binomial_var > 0 and n_blocks > 1:
        m_bar = total / n_blocks
        ratio_var = ((hits - p * m) ** 2).sum().item() / (n_blocks * (n_blocks - 1) * m_bar**2)
        deff = min(largest, max(1.0, ratio_var / binomial_var))
    return Estimate(p, *wilson_interval(p, total / deff), int(total))


def scaled(e: Estimate, factor: float, offset: float = 0.0) -> Estimate:
    """``offset + factor · e`` with its interval (a mean of a count that is ``factor`` times a
    pooled proportion, e.g. the mean matched prefix = B · pooled prefix agree)."""
    return Estimate(offset + factor * e.value, offset + factor * e.lo, offset + factor * e.hi, e.n)


def mean_estimate(
    values: torch.Tensor,
    bounds: tuple[float, float] = (-math.inf, math.inf),
    n_obs: int | None = None,
) -> Estimate:
    """Mean of independent ``values`` with a Student-t 95% interval clipped to ``bounds`` (NaN for
    one value); ``n_obs`` overrides the reported count."""
    x = values.double().flatten()
    n = x.numel()
    if n == 0:
        raise ValueError("a mean needs at least one value")
    mean = x.mean().item()
    lo = hi = math.nan
    if n > 1:
        lo, hi = t_interval(mean, n, x.std().item(), math.sqrt(n))
        lo, hi = max(bounds[0], lo), min(bounds[1], hi)
    return Estimate(mean, lo, hi, n if n_obs is None else n_obs)


def t_interval(value: float, n: int, scale: float, divisor: float = 1.0) -> tuple[float, float]:
    """The Student-t 95% interval around ``value`` from ``n`` >= 2 units of standard error
    ``scale / divisor``, computed t · scale / divisor in that order (the bounds keep every bit)."""
    half = float(stats.t.ppf(0.975, n - 1)) * scale / divisor
    return value - half, value + half


def pooled_mean(
    values: torch.Tensor, bounds: tuple[float, float] = (-math.inf, math.inf)
) -> Estimate:
    """Mean over all of ``[n, B]`` values, the interval taken over per-block means (blocks are the
    independent units; with equal block sizes the grand mean is the mean of block means)."""
    return mean_estimate(values.double().mean(dim=1), bounds, n_obs=values.numel())


def percentiles(values: torch.Tensor, fractions: dict[str, float]) -> dict[str, float]:
    """llama.cpp's percentile: linear interpolation between sorted values at fraction·(N − 1)."""
    x = values.double().flatten().sort().values
    if x.numel() == 0:
        raise ValueError("percentiles need at least one value")
    out = {}
    for name, fraction in fractions.items():
        pos = fraction * (x.numel() - 1)
        i = math.floor(pos)
        frac = pos - i
        j = min(i + 1, x.numel() - 1)
        out[name] = ((1 - frac) * x[i] + frac * x[j]).item()
    return out


BOOTSTRAP_RESAMPLES = 1000  # percentile-interval resamples; Monte Carlo error ~0.01 in a bound
BOOTSTRAP_SEED = 0  # a fixed generator: the same data give the same interval on every run


def _pearson(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Row-wise Pearson r of [..., N] float64 pairs (NaN where a side is constant)."""
    dx, dy = x - x.mean(-1, keepdim=True), y - y.mean(-1, keepdim=True)
    return ((dx * dy).sum(-1) / torch.sqrt((dx * dx).sum(-1) * (dy * dy).sum(-1))).clamp(-1, 1)


def pearson_r(
    x: torch.Tensor,
    y: torch.Tensor,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Estimate:
    """Pearson r of paired ``[n, B]`` values (rows: independent blocks; 1-D: a block each) with a
    percentile block-bootstrap 95% interval; NaN when a side is constant, exactly 1 for identical
    inputs (sxy == sxx and sqrt(sxx·sxx) == sxx in IEEE arithmetic)."""
    x2, y2 = (
        t.double().reshape(t.shape[0], -1) if t.ndim > 1 else t.double()[:, None] for t in (x, y)
    )
    r = _pearson(x2.flatten(), y2.flatten()).item()
    n_blocks, n = x2.shape[0], x2.numel()
    lo = hi = math.nan
    if abs(r) == 1:
        lo = hi = r
    elif math.isfinite(r) and n_blocks > 1:
        gen = torch.Generator().manual_seed(seed)
        draws = []
        for start in range(0, resamples, 100):  # [100, n_blocks·B] temporaries at most
            rows = torch.randint(
                0, n_blocks, (min(100, resamples - start), n_blocks), generator=gen
            )
            draws.append(_pearson(x2[rows].flatten(1), y2[rows].flatten(1)))
        boot = torch.cat(draws)
        boot = boot[boot.isfinite()]
        if boot.numel():
            lo, hi = torch.quantile(
                boot, torch.tensor([0.025, 0.975], dtype=torch.float64)
            ).tolist()
            lo, hi = min(lo, r), max(hi, r)
    return Estimate(r, lo, hi, n)
