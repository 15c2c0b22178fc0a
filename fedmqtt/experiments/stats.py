"""Statistics behind `fedmqtt report`'s claims: bootstrap intervals, paired tests, Holm's correction.

Values come as a matrix per method: one row per site, one column per seed, NaN where undefined.

- Intervals: percentile bootstrap (scipy.stats.bootstrap, seeded) resampling SITES: each replicate draws
  sites with replacement and uses the drawn sites in every seed, because one site's values in different
  seeds are not independent (the same patients). Seeds are not resampled: with one seed, the interval
  says nothing about seed-to-seed variation.
- Paired tests: two methods are paired by (site, seed), the Wilcoxon signed-rank test (scipy.stats.wilcoxon,
  two-sided, zero differences dropped) on the differences, Holm's step-down correction across every
  comparison of a table. Pairs of one site in several seeds are not independent either: with many seeds
  and few sites the p-value is optimistic (the interval of the median difference is not).
- Effect sizes: the median paired difference with its bootstrap interval (sites resampled as above) and
  the matched-pairs rank-biserial correlation (+1: the first method is higher in every pair).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
N_RESAMPLES = 2000
BOOTSTRAP_SEED = 0  # the same interval every time the same runs are reported
Interval = tuple[float, float]


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (family-wise error), in the input order; None stays None and does
    not count towards the number of comparisons.

    Sorted ascending, the i-th smallest of m (1-based) becomes max over j <= i of min(1, (m - j + 1) p_(j)).
    """
    defined = sorted((p, k) for k, p in enumerate(p_values) if p is not None)
    m = len(defined)
    out: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, k) in enumerate(defined):
        running = max(running, min(1.0, (m - rank) * p))
        out[k] = running
    return out


def _defined_sites(matrix: np.ndarray) -> np.ndarray:
    m = np.asarray(matrix, dtype=np.float64).reshape(np.shape(matrix)[0], -1)
    return m[~np.isnan(m).all(axis=1)]


def site_seed_mean(matrix: np.ndarray) -> float | None:
    """Mean over seeds of each seed's unweighted mean over the sites where defined (the tables' mean column)."""
    value = _mean_over_seeds(_defined_sites(matrix)[None, ...])[0]
    return None if np.isnan(value) else float(value)


def _mean_over_seeds(drawn: np.ndarray) -> np.ndarray:
    """drawn (..., sites, seeds) -> (...,): per seed the mean over defined sites, then over defined seeds."""
    ok = ~np.isnan(drawn)
    sums, counts = np.where(ok, drawn, 0.0).sum(axis=-2), ok.sum(axis=-2)
    per_seed = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
    seeds = (counts > 0).sum(axis=-1)
    return np.divide(per_seed.sum(axis=-1), seeds, out=np.full(seeds.shape, np.nan), where=seeds > 0)


def _median_of_all(drawn: np.ndarray) -> np.ndarray:
    """drawn (..., sites, seeds) -> (...,): the median of every defined value (each drawn site has one)."""
    flat = drawn.reshape(*drawn.shape[:-2], -1)
    return np.nanmedian(flat, axis=-1)


def site_bootstrap(matrix: np.ndarray, reduce: Callable[[np.ndarray], np.ndarray], *,
                   confidence: float = CONFIDENCE, seed: int = BOOTSTRAP_SEED) -> Interval | None:
    """Percentile bootstrap interval of `reduce` (drawn sites x seeds -> value), resampling the matrix's
    sites with replacement (the same draw in every seed). None with fewer than two sites with a value."""
    from scipy.stats import bootstrap

    rows = _defined_sites(matrix)
    if rows.shape[0] < 2:
        return None

    def statistic(idx: np.ndarray, axis: int = -1) -> np.ndarray:
        return reduce(rows[np.moveaxis(np.asarray(idx, dtype=np.int64), axis, -1)])

    result = bootstrap((np.arange(rows.shape[0]),), statistic, vectorized=True, n_resamples=N_RESAMPLES,
                       confidence_level=confidence, method="percentile", random_state=np.random.default_rng(seed))
    low, high = result.confidence_interval
    return float(low), float(high)


def mean_interval(matrix: np.ndarray, *, confidence: float = CONFIDENCE, seed: int = BOOTSTRAP_SEED) -> Interval | None:
    """Bootstrap interval of `site_seed_mean` (sites resampled)."""
    return site_bootstrap(matrix, _mean_over_seeds, confidence=confidence, seed=seed)


@dataclass(frozen=True)
class Paired:
    """Two methods compared on their (site, seed) pairs: differences a - b."""

    n: int  # pairs with both values defined
    p: float | None  # Wilcoxon signed-rank, two-sided; None without a pair
    median: float | None
    interval: Interval | None  # bootstrap interval of the median difference, sites resampled
    rank_biserial: float | None  # None when every difference is 0


def rank_biserial(differences: np.ndarray) -> float | None:
    """Matched-pairs rank-biserial correlation (Kerby): (R+ - R-) / (R+ + R-), with R+/R- the sums of the
    ranks of |d| over positive/negative differences (average ranks for ties, zeros dropped)."""
    from scipy.stats import rankdata

    d = np.asarray(differences, dtype=np.float64)
    d = d[d != 0]
    if d.size == 0:
        return None
    ranks = rankdata(np.abs(d))
    return float((ranks[d > 0].sum() - ranks[d < 0].sum()) / ranks.sum())


def paired(a: np.ndarray, b: np.ndarray) -> Paired:
    """Compare two sites x seeds matrices on the same (site, seed) grid (NaN where undefined)."""
    from scipy.stats import wilcoxon

    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)  # NaN where either is
    values = diff[~np.isnan(diff)]
    if values.size == 0:
        return Paired(0, None, None, None, None)
    # No nonzero difference: nothing to rank, the two methods agree on every pair.
    p = float(wilcoxon(values).pvalue) if np.any(values != 0) else 1.0
    return Paired(n=int(values.size), p=p, median=float(np.median(values)),
                  interval=site_bootstrap(diff, _median_of_all), rank_biserial=rank_biserial(values))
