"""Point estimates with 95% intervals (the ``Estimate`` of every results entry), and the
interval each kind of quantity gets (metrics.py defines the quantities):

* per-position proportions (greedy / seq / prefix agree[k]): Wilson score interval over blocks,
  which are independent.  Wilson rather than Wald because Wald collapses to zero width at 0 and 1
  — where bf16's agreement sits — and under-covers near them (Brown, Cai & DasGupta, Statistical
  Science 16(2), 2001); Wilson stays inside [0, 1] with near-nominal coverage.
* pooled proportions (flip rate, agreement over all positions): positions of one block share a
  context and the flip threshold, so they are not independent trials.  Wilson on Kish's effective
  sample size N / deff, deff = (variance of the mean from per-block proportions) / (binomial
  variance), never below 1.
* means (1−TV[k], ceiling, KL): Student-t interval over blocks; for means pooled over positions,
  over per-block means (same clustering argument).  Clipped to the quantity's range.
* Pearson r: Fisher z, tanh(atanh r ± z/√(N − 3)) over the N tokens (an iid approximation).
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
        """Plain dict; non-finite numbers (an undefined r, an interval from one block) become None."""
        return {"value": json_number(self.value), "lo": json_number(self.lo),
                "hi": json_number(self.hi), "n": self.n}


# ---------------------------------------------------------------------------------------------
# Intervals and summaries


def wilson_interval(p_hat: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a proportion ``p_hat`` observed over ``n`` trials.

    ``n`` may be an effective (non-integer) sample size.  The bounds at ``p_hat`` 0 and 1 are set
    exactly (0 and 1) rather than left to rounding.
    """
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


def pooled_proportion(hits: torch.Tensor) -> Estimate:
    """Share of True over all of ``[n, B]`` hits whose rows (blocks) are independent but whose
    positions within a row need not be: Wilson interval on Kish's effective sample size."""
    n_blocks, width = hits.shape
    total = n_blocks * width
    if total == 0:
        raise ValueError("a proportion needs at least one block")
    p = hits.sum().item() / total
    binomial_var = p * (1 - p) / total
    deff = 1.0
    if binomial_var > 0 and n_blocks > 1:
        clustered_var = hits.double().mean(dim=1).var().item() / n_blocks
        deff = max(1.0, clustered_var / binomial_var)
    return Estimate(p, *wilson_interval(p, total / deff), total)


def mean_estimate(values: torch.Tensor, bounds: tuple[float, float] = (-math.inf, math.inf),
                  n_obs: int | None = None) -> Estimate:
    """Mean of independent ``values`` with a Student-t 95% interval, clipped to ``bounds``.

    One value gives no interval (NaN bounds).  ``n_obs`` overrides the reported count.
    """
    x = values.double().flatten()
    n = x.numel()
    if n == 0:
        raise ValueError("a mean needs at least one value")
    mean = x.mean().item()
    lo = hi = math.nan
    if n > 1:
        half = float(stats.t.ppf(0.975, n - 1)) * x.std().item() / math.sqrt(n)
        lo, hi = max(bounds[0], mean - half), min(bounds[1], mean + half)
    return Estimate(mean, lo, hi, n if n_obs is None else n_obs)


def pooled_mean(values: torch.Tensor, bounds: tuple[float, float] = (-math.inf, math.inf)) -> Estimate:
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


def pearson_r(x: torch.Tensor, y: torch.Tensor) -> Estimate:
    """Pearson correlation of paired values with a Fisher-z 95% interval.

    NaN when either side is constant.  Written so that identical inputs give exactly 1:
    sxy == sxx and sqrt(sxx·sxx) == sxx in IEEE arithmetic.
    """
    dx = x.double().flatten() - x.double().mean()
    dy = y.double().flatten() - y.double().mean()
    n = dx.numel()
    r = ((dx * dy).sum() / torch.sqrt((dx * dx).sum() * (dy * dy).sum())).clamp(-1, 1).item()
    lo = hi = math.nan
    if abs(r) == 1:
        lo = hi = r
    elif math.isfinite(r) and n > 3:
        z, half = math.atanh(r), Z95 / math.sqrt(n - 3)
        lo, hi = math.tanh(z - half), math.tanh(z + half)
    return Estimate(r, lo, hi, n)
