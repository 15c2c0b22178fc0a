"""Federated feature statistics on the wire (docs/data-preparation.md): a site's sums over its training values,
and the statistics the federation derives from their total.

Every field of `FeatureSummary` is a sum over the site's training values (counts, sums, sums of squares, a
histogram on a fixed grid), so summaries combine by addition, in the clear or as a secure sum. Validation
checks more than ranges: each column's histogram must count exactly its observed values, and its sum and sum of
squares must be ones those values can have (inside the grid, Cauchy-Schwarz), so a site cannot shift the
federation's mean or spread with sums its histogram contradicts.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from schemas.base import MAX_COUNT, Count, Header, Label, Real, Session, SiteName

MAX_COLUMNS = 4096  # ICU stays have 82 channels, the widest table a few hundred
MAX_BINS = 4096
# Sums of squares of values up to the asinh grid's 1e9 over 2**53 values stay far below this; 10 000 sites'
# worth still adds up to a finite float64.
MAX_SQUARES = 1e250
Squares = Annotated[float, Field(allow_inf_nan=False, ge=0, le=MAX_SQUARES)]
Columns = Annotated[tuple[Label, ...], Field(min_length=1, max_length=MAX_COLUMNS)]
PerColumn = Annotated[tuple[Real, ...], Field(max_length=MAX_COLUMNS)]
# Relative slack for float sums re-added in another order
_SLACK = 1e-9


class FeatureSummary(Header):
    """Site -> PS, before round 1: its training columns as additive sums (counts, sums, squares, a histogram).

    Sent once, retained on the site's `features` topic, when the run standardises with the federation's
    statistics (`feature_statistics = "federated"`); a simulation combines its sites' summaries in process
    (fedmqtt/federation_stats.py)."""

    kind: Literal["feature_summary"] = "feature_summary"
    session: Session = ""
    columns: Columns
    # The histogram grid, per column: [low, high] split into `bins` bins equal in the value or in asinh(value)
    scale: Annotated[tuple[Literal["linear", "asinh"], ...], Field(max_length=MAX_COLUMNS)]
    low: PerColumn
    high: PerColumn
    bins: int = Field(ge=2, le=MAX_BINS)
    entries: Count  # values per column, observed or missing
    count: Annotated[tuple[Count, ...], Field(max_length=MAX_COLUMNS)]
    total: PerColumn
    total_sq: Annotated[tuple[Squares, ...], Field(max_length=MAX_COLUMNS)]
    histogram: Annotated[tuple[Count, ...], Field(max_length=MAX_COLUMNS * MAX_BINS)]  # column-major: c x bins
    # Columns every site leaves as they are (ICU masks): the data's, the same at every site
    fixed: Annotated[tuple[Annotated[int, Field(ge=0, lt=MAX_COLUMNS)], ...], Field(max_length=MAX_COLUMNS)] = ()

    @model_validator(mode="after")
    def _consistent(self) -> FeatureSummary:
        c = len(self.columns)
        for name in ("scale", "low", "high", "count", "total", "total_sq"):
            if len(getattr(self, name)) != c:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {c} columns")
        if len(self.histogram) != c * self.bins:
            raise ValueError(f"histogram has {len(self.histogram)} counts, not {c} columns x {self.bins} bins")
        if any(j >= c for j in self.fixed) or list(self.fixed) != sorted(set(self.fixed)):
            raise ValueError(f"fixed columns must be distinct, ascending and below {c}")
        if sum(self.histogram) > MAX_COUNT:
            raise ValueError("histogram counts beyond the largest count")
        for j, name in enumerate(self.columns):
            lo, hi, n = self.low[j], self.high[j], self.count[j]
            if not lo < hi:
                raise ValueError(f"column {name!r}: grid low {lo} is not below high {hi}")
            if n > self.entries:
                raise ValueError(f"column {name!r}: {n} observed values of {self.entries}")
            if sum(self.histogram[j * self.bins:(j + 1) * self.bins]) != n:
                raise ValueError(f"column {name!r}: the histogram does not count its {n} observed values")
            s, q = self.total[j], self.total_sq[j]
            slack = _SLACK * n * max(abs(lo), abs(hi))
            if not n * lo - slack <= s <= n * hi + slack:
                raise ValueError(f"column {name!r}: sum {s:g} impossible for {n} values in [{lo:g}, {hi:g}]")
            if s * s > n * q * (1 + _SLACK) + _SLACK or q > n * max(lo * lo, hi * hi) * (1 + _SLACK):
                raise ValueError(f"column {name!r}: sum of squares {q:g} impossible with sum {s:g} of {n} values")
        return self


OptionalBound = Real | None


class FeatureStatistics(Header):
    """PS -> sites: the federation's clip bounds, fill values, means and scales, from the summed summaries.

    Every site clips, fills and standardises its columns with them (fedmqtt.data.feature_stats); a simulation
    writes it into its run folder as feature_statistics.json and the sites' data specs name it."""

    kind: Literal["feature_statistics"] = "feature_statistics"
    session: Session = ""
    columns: Columns
    sites: Annotated[tuple[SiteName, ...], Field(min_length=1, max_length=10_000)]  # whose summaries are in it
    entries: Count
    low: Annotated[tuple[OptionalBound, ...], Field(max_length=MAX_COLUMNS)]  # None: not clipped
    high: Annotated[tuple[OptionalBound, ...], Field(max_length=MAX_COLUMNS)]
    fill: PerColumn
    mean: PerColumn
    # 0: the column is 0 at every site (constant or never observed in the federation's training values)
    std: Annotated[tuple[Annotated[float, Field(allow_inf_nan=False, ge=0, le=1e15)], ...],
                   Field(max_length=MAX_COLUMNS)]

    @model_validator(mode="after")
    def _consistent(self) -> FeatureStatistics:
        c = len(self.columns)
        for name in ("low", "high", "fill", "mean", "std"):
            if len(getattr(self, name)) != c:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {c} columns")
        for j, name in enumerate(self.columns):
            lo, hi = self.low[j], self.high[j]
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"column {name!r}: clip low {lo} above high {hi}")
        return self
