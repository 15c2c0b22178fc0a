"""Federated feature statistics: the sites' sums combine into exactly the pooled rows' statistics, the derived
clip bounds, fill values, means and scales follow the local rule on the pooled rows to within a bin, and hostile
summaries and statistics files are refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmqtt.data.feature_stats import (
    HIST_BINS,
    MIN_VALUES,
    Summary,
    column_grid,
    combine,
    derive,
    standardise_with,
    summarise,
)
from fedmqtt.data.feature_wire import (
    combine_messages,
    read_statistics,
    statistics_from_message,
    summary_message,
    write_statistics,
)
from fedmqtt.data.splits import clip, clip_bounds, train_statistics
from fedmqtt.errors import DataError, SchemaError
from schemas.codec import WireError, decode, encode, pack
from schemas.feature_stats import FeatureStatistics, FeatureSummary

NAMES = ("ph", "alt", "flag", "age")
RANGES = {"ph": (6.5, 8.0), "alt": (1.0, 20000.0)}


def _rows(rng: np.random.Generator, n: int, missing: float = 0.2) -> np.ndarray:
    """Clinical-looking columns: a narrow pH, a skewed laboratory value, a 0/1 flag, an age without a range."""
    x = np.column_stack([rng.normal(7.4, 0.06, n), np.exp(rng.normal(3.5, 1.2, n)).clip(1, 20000),
                         (rng.random(n) < 0.3).astype(float), rng.uniform(18, 95, n)])
    x[rng.random(x.shape) < missing] = np.nan
    return x


def _pooled_equal(a: Summary, b: Summary) -> None:
    assert a.entries == b.entries
    np.testing.assert_array_equal(a.count, b.count)
    np.testing.assert_array_equal(a.histogram, b.histogram)
    np.testing.assert_allclose(a.total, b.total, rtol=1e-12)
    np.testing.assert_allclose(a.total_sq, b.total_sq, rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(min_value=MIN_VALUES * 3, max_value=80), min_size=1, max_size=6),
       seed=st.integers(0, 2**32 - 1))
def test_combined_sites_equal_the_pooled_rows(sizes: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    grid = column_grid(NAMES, RANGES)
    parts = [_rows(rng, n, missing=0.0) for n in sizes]  # no column falls under MIN_VALUES at any site
    combined = combine(summarise(p, grid) for p in parts)
    pooled = summarise(np.concatenate(parts), grid)
    _pooled_equal(combined, pooled)
    a, b = derive(combined, grid), derive(pooled, grid)
    for field in ("low", "high", "fill", "mean", "std"):
        np.testing.assert_allclose(getattr(a, field), getattr(b, field), rtol=1e-9)


def test_derived_statistics_follow_the_local_rule_on_the_pooled_rows() -> None:
    """Clip bounds and medians next to the pooled rows' own (between the order statistics around them, within a
    bin), means and stds within 1 %: what every site would have computed had it held every training row
    (fedmqtt.data.splits); the flag column exactly."""
    rng = np.random.default_rng(7)
    sites = [_rows(rng, n) for n in (12, 30, 400, 2000)]
    grid = column_grid(NAMES, RANGES)
    fed = derive(combine(summarise(s, grid) for s in sites), grid)
    pooled = np.concatenate(sites)
    low, high = clip_bounds(pooled)
    fill, mean, std = train_statistics(clip(pooled, low, high))
    for j in range(len(NAMES)):
        edges = grid.edges(j)
        values = np.sort(pooled[~np.isnan(pooled[:, j]), j])
        checks = ((fed.low[j], low[j], 0.005), (fed.high[j], high[j], 0.995), (fed.fill[j], fill[j], 0.5))
        for ours, theirs, q in checks:
            if np.isinf(theirs):
                assert ours == theirs
                continue
            # between the order statistics around the quantile's position, widened by the bins they lie in
            k = q * (values.size - 1)
            below, above = values[max(int(np.floor(k)) - 1, 0)], values[min(int(np.ceil(k)) + 1, values.size - 1)]
            width = np.diff(edges)[np.clip(np.searchsorted(edges, [below, above]) - 1, 0, HIST_BINS - 1)]
            assert below - width[0] <= ours <= above + width[1], (NAMES[j], q, ours, theirs)
    np.testing.assert_allclose(fed.mean, mean, rtol=0.01)
    np.testing.assert_allclose(fed.std, std, rtol=0.01)
    flag = NAMES.index("flag")  # two values: exact from the sums, never clipped
    assert (fed.low[flag], fed.high[flag]) == (-np.inf, np.inf)
    assert fed.fill[flag] == pytest.approx(fill[flag], abs=1e-12)
    assert fed.mean[flag] == pytest.approx(mean[flag], rel=1e-12)
    assert fed.std[flag] == pytest.approx(std[flag], rel=1e-9)


def test_small_sites_get_the_federation_scale() -> None:
    """The case that motivated it: a site of six rows with a unit error standardises to |z| in the hundreds on
    its own statistics, and to moderate values with the federation's."""
    rng = np.random.default_rng(3)
    big = _rows(rng, 3000, missing=0.0)
    small = _rows(rng, 6, missing=0.0)
    small[0, 0] = 7.99  # extreme but plausible
    grid = column_grid(NAMES, RANGES)
    stats = derive(combine([summarise(big, grid), summarise(small, grid)]), grid)
    z = standardise_with(small, stats)
    assert np.abs(z[:, 0]).max() < 6  # clipped to the federation's 99.5 % quantile first
    assert np.isfinite(z).all()


def test_rare_column_is_withheld_and_constant_column_zeroed() -> None:
    grid = column_grid(NAMES, RANGES)
    x = _rows(np.random.default_rng(1), 50, missing=0.0)
    x[:, 1] = np.nan
    x[: MIN_VALUES - 1, 1] = 40.0  # four values: withheld, never leave the site
    x[:, 3] = 60.0  # constant
    s = summarise(x, grid)
    assert s.count[1] == 0 and s.total[1] == 0 and s.histogram[1].sum() == 0
    stats = derive(s, grid)
    assert np.isinf(stats.std[1]) and np.isinf(stats.std[3])
    z = standardise_with(x, stats)
    assert (z[:, 1] == 0).all() and (z[:, 3] == 0).all()


def test_fixed_channels_are_left_as_they_are() -> None:
    grid = column_grid(NAMES, RANGES)
    x = _rows(np.random.default_rng(2), 100, missing=0.0)
    stats = derive(summarise(x, grid), grid, fixed=(2,))
    assert (stats.low[2], stats.high[2], stats.fill[2], stats.mean[2], stats.std[2]) == (-np.inf, np.inf, 0, 0, 1)


def _message(x: np.ndarray, sender: str) -> FeatureSummary:
    grid = column_grid(NAMES, RANGES)
    return summary_message(summarise(x, grid), grid, NAMES, run_id="run", sender=sender)


def test_messages_through_the_codec_combine_like_the_sums() -> None:
    rng = np.random.default_rng(5)
    parts = {f"site-{k}": _rows(rng, n) for k, n in enumerate((40, 90, 300))}
    received = []
    for site, x in parts.items():
        msg = decode(encode(_message(x, site)))
        assert isinstance(msg, FeatureSummary)
        received.append(msg)
    stats = combine_messages(received, run_id="run")
    assert stats.sites == tuple(sorted(parts))
    decoded = decode(encode(stats))  # a JSON kind: observers read it with plain MQTT clients
    assert isinstance(decoded, FeatureStatistics)
    grid = column_grid(NAMES, RANGES)
    want = derive(combine(summarise(x, grid) for x in parts.values()), grid)
    got = statistics_from_message(decoded)
    for field in ("low", "high", "fill", "mean", "std"):
        np.testing.assert_allclose(getattr(got, field), getattr(want, field), rtol=1e-12)


def _raw(msg: FeatureSummary, **changes: object) -> bytes:
    return pack({**msg.model_dump(mode="python"), **changes})


@pytest.mark.parametrize("change", [
    "histogram_short", "histogram_miscount", "sum_outside_grid", "sum_of_squares_too_small", "nan_sum",
    "inf_squares", "count_above_entries", "too_many_bins", "negative_count", "grid_reversed",
])
def test_hostile_summaries_are_refused(change: str) -> None:
    msg = _message(_rows(np.random.default_rng(0), 60), "site-a")
    hist = list(msg.histogram)
    c = len(NAMES)
    changes: dict[str, object] = {
        "histogram_short": {"histogram": hist[:-1]},
        "histogram_miscount": {"histogram": [hist[0] + 1, *hist[1:]]},
        "sum_outside_grid": {"total": [msg.count[0] * 9.0, *msg.total[1:]]},  # pH above 8 on average
        "sum_of_squares_too_small": {"total_sq": [msg.total_sq[0] / 2, *msg.total_sq[1:]]},
        "nan_sum": {"total": [float("nan"), *msg.total[1:]]},
        "inf_squares": {"total_sq": [float("inf"), *msg.total_sq[1:]]},
        "count_above_entries": {"entries": 1},
        "too_many_bins": {"bins": 10**6, "histogram": hist},
        "negative_count": {"count": [-1, *msg.count[1:]]},
        "grid_reversed": {"low": list(msg.high), "high": list(msg.low)},
    }[change]
    assert c == len(msg.columns)
    with pytest.raises(WireError):
        decode(_raw(msg, **changes))


def test_a_summary_is_refused_before_decoding_when_too_large() -> None:
    msg = _message(_rows(np.random.default_rng(0), 60), "site-a")
    data = encode(msg)
    with pytest.raises(WireError, match="exceeds"):
        decode(data, max_bytes=len(data) - 1)


def test_combination_refuses_a_second_summary_of_one_site_and_other_grids() -> None:
    rng = np.random.default_rng(4)
    a, b = _message(_rows(rng, 40), "site-a"), _message(_rows(rng, 40), "site-a")
    with pytest.raises(SchemaError, match="two feature summaries"):
        combine_messages([a, b], run_id="run")
    grid = column_grid(NAMES, {})
    other = summary_message(summarise(_rows(rng, 40), grid), grid, NAMES, run_id="run", sender="site-b")
    with pytest.raises(SchemaError, match="another grid"):
        combine_messages([a, other], run_id="run")
    with pytest.raises(SchemaError, match="no feature summary"):
        combine_messages([], run_id="run")


def test_statistics_file_is_checked_like_a_message(tmp_path) -> None:  # type: ignore[no-untyped-def]
    stats = combine_messages([_message(_rows(np.random.default_rng(6), 80), "site-a")], run_id="run")
    path = tmp_path / "feature_statistics.json"
    write_statistics(stats, path)
    assert read_statistics(path, NAMES).mean.shape == (len(NAMES),)
    with pytest.raises(DataError, match="columns"):
        read_statistics(path, ("a", "b", "c", "d"))
    path.write_text(path.read_text().replace('"std":[', '"std":[-1,', 1))
    with pytest.raises(DataError, match="not valid feature statistics"):
        read_statistics(path, NAMES)
    path.write_bytes(b"{" + b" " * (5 * 1024 * 1024) + b"}")
    with pytest.raises(DataError, match="bytes"):
        read_statistics(path, NAMES)
    with pytest.raises(DataError, match="not found"):
        read_statistics(tmp_path / "missing.json", NAMES)


def test_a_stay_repeating_one_value_counts_once_for_withholding() -> None:
    """An ICU stay carries one measurement forward over 48 hours: 48 values, one patient. A column seen in
    fewer than MIN_VALUES stays is withheld however many hours repeat it."""
    grid = column_grid(("ph", "hr"), {"ph": (6.5, 8.0)})
    x = np.full((MIN_VALUES + 2, 48, 2), np.nan)
    x[:, :, 1] = 80.0 + np.arange(MIN_VALUES + 2)[:, None]  # heart rate in every stay
    x[: MIN_VALUES - 1, :, 0] = 7.31  # pH in four stays, every hour
    s = summarise(x, grid)
    assert s.entries == (MIN_VALUES + 2) * 48
    assert s.count[0] == 0 and s.total[0] == 0 and s.histogram[0].sum() == 0
    assert s.count[1] == (MIN_VALUES + 2) * 48
