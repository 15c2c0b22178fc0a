"""Federated feature statistics: what each site sends about its training columns, how the sums combine, and the
clip bounds, fill values, means and scales every site then standardises with (docs/data-preparation.md).

Why: a site of 6-113 training rows estimates a column's 0.5 % quantile, median and spread badly, and every
site standardising with its own statistics feeds the shared model differently scaled inputs. The federation's
statistics come from every site's training rows at once, as if pooled, yet no row leaves a site.

What a site sends (`Summary`), per column, all of it sums over its training rows, so the PS combines sites by
adding (and could take the sums from secure aggregation unchanged): the number of values (observed or not), the
observed count, sum and sum of squares, and a histogram on a fixed grid every party derives from the column's
plausible range (`column_grid`). The histogram is the quantile sketch: bounded size (HIST_BINS per column),
mergeable by addition, and coarse: a value is only known to its bin, never as a raw quantile of a few rows.

From the combined sums (`derive`), per column, the same rule as a site's local statistics
(fedmqtt.data.splits) on the pooled rows, read off the histogram: clip bounds at the CLIP_QUANTILES (columns
with fewer than CLIP_MIN_DISTINCT occupied bins are not clipped, as binary columns are not locally), the median
as the fill value, and the mean and std of the clipped, imputed column (bin centres), all exact to within a
bin; a column of one or two values (flags, one-hot) is exact from its sums.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fedmqtt.data.plausible import Range
from fedmqtt.data.splits import CLIP_MIN_DISTINCT, CLIP_QUANTILES, clip, is_constant, standardise

HIST_BINS = 512
# Bins are equal in asinh(value): linear near 0, logarithmic beyond, so one grid holds a 0/1 flag, a pH and a
# laboratory value skewed into the thousands (ALT: median 31 IU/L, plausible up to 20,000) with a resolution
# that follows the value. A column's grid spans its plausible range; one without a range spans +-ASINH_LIMIT
# (bins about 8 % of the value wide far from 0).
ASINH_LIMIT = 1e9
# `feature_statistics = "auto"`: the federation's statistics when the smallest site has fewer training rows than
# this (its 0.5 % quantiles then rest on at most two values per tail and its std on few rows); per-site otherwise.
SMALL_SITE_ROWS = 500
# A site withholds a column observed in fewer of its items (rows, stays) than this (it sends it as never
# observed): the sum of one to four patients' values, or their bins, would come close to their own values.
MIN_VALUES = 5
Scale = Literal["linear", "asinh"]
LINEAR: Scale = "linear"
ASINH: Scale = "asinh"


@dataclass(frozen=True)
class Grid:
    """Per column: the histogram's range [low, high] and whether bins are equal in the value (linear) or in
    asinh(value). Values outside are counted at the nearest bound (a summary never holds one beyond it)."""

    low: tuple[float, ...]
    high: tuple[float, ...]
    scale: tuple[Scale, ...]
    bins: int = HIST_BINS

    def forward(self, j: int, values: np.ndarray) -> np.ndarray:
        return np.arcsinh(values) if self.scale[j] == ASINH else np.asarray(values, dtype=np.float64)

    def inverse(self, j: int, t: np.ndarray) -> np.ndarray:
        return np.sinh(t) if self.scale[j] == ASINH else t

    def edges(self, j: int) -> np.ndarray:
        """The bins + 1 edges of column j, in the value's own units."""
        lo, hi = self.forward(j, np.array([self.low[j], self.high[j]]))
        return np.asarray(self.inverse(j, np.linspace(lo, hi, self.bins + 1)))

    def bin_of(self, j: int, values: np.ndarray) -> np.ndarray:
        """The bin index of each (finite, within-range) value of column j."""
        lo, hi = self.forward(j, np.array([self.low[j], self.high[j]]))
        pos = (self.forward(j, values) - lo) / (hi - lo) * self.bins
        return np.clip(np.floor(pos), 0, self.bins - 1).astype(np.int64)


def column_grid(names: Sequence[str], ranges: Mapping[str, Range], bins: int = HIST_BINS) -> Grid:
    """Per column: its plausible range where it has one, else +-ASINH_LIMIT, in bins equal in asinh(value)."""
    low = tuple(float(ranges[n][0]) if n in ranges else -ASINH_LIMIT for n in names)
    high = tuple(float(ranges[n][1]) if n in ranges else ASINH_LIMIT for n in names)
    return Grid(low, high, tuple(ASINH for _ in names), bins)


@dataclass(frozen=True)
class Summary:
    """One site's (or the federation's) sums over training values, per column: additive in every field."""

    entries: int  # values per column, observed or missing (rows, times hours for ICU stays)
    count: np.ndarray  # (c,) int64 observed values
    total: np.ndarray  # (c,) float64 sum of observed values
    total_sq: np.ndarray  # (c,) float64 sum of their squares
    histogram: np.ndarray  # (c, bins) int64

    def __add__(self, other: Summary) -> Summary:
        if self.histogram.shape != other.histogram.shape:
            raise ValueError(f"summaries of different layouts: {self.histogram.shape} and {other.histogram.shape}")
        return Summary(self.entries + other.entries, self.count + other.count, self.total + other.total,
                       self.total_sq + other.total_sq, self.histogram + other.histogram)


def summarise(x_train: np.ndarray, grid: Grid) -> Summary:
    """A site's Summary of its training values (items on the first axis, columns on the last, NaN = missing),
    each value first brought inside its column's grid so that the sums and the histogram describe the same
    numbers; a column observed in fewer than MIN_VALUES items is withheld (sent as never observed). Items, not
    values: an ICU stay repeats one measurement over many hours, and 48 copies of one value are still one
    patient's value."""
    x = np.asarray(x_train, dtype=np.float64)
    flat = x.reshape(-1, x.shape[-1])
    c = flat.shape[1]
    if len(grid.low) != c:
        raise ValueError(f"{c} columns but a grid of {len(grid.low)}")
    items_observed = (~np.isnan(x.reshape(x.shape[0], -1, c))).any(axis=1).sum(axis=0)
    count = np.zeros(c, dtype=np.int64)
    total = np.zeros(c)
    total_sq = np.zeros(c)
    hist = np.zeros((c, grid.bins), dtype=np.int64)
    for j in range(c):
        if items_observed[j] < MIN_VALUES:
            continue  # withheld (MIN_VALUES): counted as missing in `entries`
        col = flat[:, j]
        col = np.clip(col[~np.isnan(col)], grid.low[j], grid.high[j])
        count[j] = col.size
        total[j] = col.sum()
        total_sq[j] = np.square(col).sum()
        hist[j] = np.bincount(grid.bin_of(j, col), minlength=grid.bins)
    return Summary(int(flat.shape[0]), count, total, total_sq, hist)


def combine(summaries: Iterable[Summary]) -> Summary:
    """The federation's Summary: the sites' summaries added (what a secure sum of them would give)."""
    items = list(summaries)
    if not items:
        raise ValueError("no summary to combine")
    out = items[0]
    for item in items[1:]:
        out = out + item
    return out


@dataclass(frozen=True)
class Statistics:
    """What every site standardises with, per column: clip to [low, high] (+-inf: not clipped), fill missing
    values with `fill`, then (x - mean) / std; std inf: the column is 0 everywhere (constant or never observed)."""

    low: np.ndarray
    high: np.ndarray
    fill: np.ndarray
    mean: np.ndarray
    std: np.ndarray


def derive(summary: Summary, grid: Grid, fixed: Sequence[int] = ()) -> Statistics:
    """The federation's Statistics from its combined Summary (module docstring); `fixed` columns (ICU masks)
    are left as they are: not clipped, fill 0, mean 0, std 1."""
    c = summary.count.shape[0]
    low, high = np.full(c, -np.inf), np.full(c, np.inf)
    fill, mean, std = np.zeros(c), np.zeros(c), np.full(c, np.inf)
    for j in range(c):
        if j in fixed:
            mean[j], std[j] = 0.0, 1.0
            continue
        n = int(summary.count[j])
        if n == 0:
            continue  # never observed: 0 everywhere, as locally
        hist = summary.histogram[j]
        missing = summary.entries - n
        if np.count_nonzero(hist) >= CLIP_MIN_DISTINCT:
            low[j], high[j] = (_quantile(hist, grid, j, q) for q in CLIP_QUANTILES)
            fill[j] = _quantile(hist, grid, j, 0.5)
            mids = np.clip(_midpoints(grid.edges(j), grid, j), low[j], high[j])
            s1, s2 = float(hist @ mids), float(hist @ np.square(mids))
        else:  # one or two values (a flag, a one-hot column): not clipped, and exact from the sums
            s1, s2 = float(summary.total[j]), float(summary.total_sq[j])
            fill[j] = _discrete_median(hist, n, s1, s2)
        m = (s1 + missing * fill[j]) / summary.entries
        var = max((s2 + missing * fill[j] ** 2) / summary.entries - m * m, 0.0)
        mean[j] = m
        if not is_constant(np.sqrt(var), m):
            std[j] = np.sqrt(var)
    return Statistics(low, high, fill, mean, std)


def _discrete_median(hist: np.ndarray, n: int, s1: float, s2: float) -> float:
    """The median of n values that take one value per occupied bin, at most two bins: the two values follow
    exactly from the count in each bin, the sum and the sum of squares (np.median's rule for even n)."""
    occupied = np.flatnonzero(hist)
    m = s1 / n
    if occupied.size == 1:
        return m
    n1, n2 = (int(hist[b]) for b in occupied)
    sd = np.sqrt(max(s2 / n - m * m, 0.0))
    v1, v2 = m - sd * np.sqrt(n2 / n1), m + sd * np.sqrt(n1 / n2)

    def value(k: int) -> float:  # the k-th smallest (0-based)
        return v1 if k < n1 else v2

    return (value((n - 1) // 2) + value(n // 2)) / 2


def _midpoints(edges: np.ndarray, grid: Grid, j: int) -> np.ndarray:
    """Each bin's centre in the grid's own scale (so an asinh bin's centre is its geometric middle)."""
    t = grid.forward(j, edges)
    return np.asarray(grid.inverse(j, (t[:-1] + t[1:]) / 2))


def _quantile(hist: np.ndarray, grid: Grid, j: int, q: float) -> float:
    """The q-quantile of the values a histogram counts, interpolated linearly (in the grid's scale) inside the
    bin where the cumulative count reaches q * n."""
    n = int(hist.sum())
    cum = np.cumsum(hist)
    target = q * n
    b = int(np.searchsorted(cum, target, side="left"))
    b = min(max(b, 0), grid.bins - 1)
    before = float(cum[b - 1]) if b > 0 else 0.0
    share = (target - before) / hist[b] if hist[b] else 0.5
    t = grid.forward(j, grid.edges(j))
    return float(grid.inverse(j, np.asarray(t[b] + min(max(share, 0.0), 1.0) * (t[b + 1] - t[b]))))


def standardise_with(part: np.ndarray, stats: Statistics) -> np.ndarray:
    """`part` (columns on the last axis) clipped, filled and standardised with `stats`, as float32."""
    return standardise(clip(part, stats.low, stats.high), stats.fill, stats.mean, stats.std)
