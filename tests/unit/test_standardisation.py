"""Per-site standardisation on awkward real-world columns: near-constant, all-missing, one training row."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from fedmqtt.data.registry import load_site_data
from fedmqtt.data.spec import DataSpec
from fedmqtt.data.splits import Z_WARN, is_constant, split_and_normalise, split_indices, train_statistics

NAMES = ("age", "ph", "lactate", "noise")


def _site(n: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = np.column_stack([
        rng.normal(60, 10, n),
        # pH recorded as 7.4 everywhere, but summed from parts: a float64 spread of ~1e-16, not 0
        np.full(n, 7.4) + rng.choice([0.0, 1e-15, -1e-15], n),
        np.full(n, np.nan),  # never measured at this hospital
        rng.normal(0, 1, n),
    ])
    return x, (np.arange(n) % 2).astype(np.int64)


def test_relative_floor_catches_rounding_noise_not_real_spread() -> None:
    assert bool(is_constant(1e-15, 7.4)) and bool(is_constant(1e-9, 1e6 * 0 + 0.0))
    assert not is_constant(1e-3, 7.4) and not is_constant(1e-4, 0.0)
    assert bool(is_constant(5e-3, 1e6)) and not is_constant(1.0, 1e6)  # relative to the magnitude


def test_near_constant_and_all_missing_columns_are_zero_in_every_split(caplog: pytest.LogCaptureFixture) -> None:
    x, y = _site()
    test_row = split_indices(y, seed=0, fractions=(0.6, 0.2, 0.2))[2][0]
    x[test_row, 1] = 7.9  # a test row off the train constant must not reach the model as 5e15
    with caplog.at_level(logging.WARNING):
        data = split_and_normalise(x, y, seed=0, feature_names=NAMES, where="site H7")
    for part in (data.x_train, data.x_val, data.x_test):
        assert np.isfinite(part).all() and np.abs(part).max() < 10
        assert (part[:, 1] == 0).all() and (part[:, 2] == 0).all()
    assert abs(float(data.x_train[:, 0].std()) - 1) < 1e-5  # a real column is still standardised
    assert any("site H7" in n and "ph" in n and "lactate" in n for n in data.notes)
    fill, mean, std = train_statistics(np.delete(x, test_row, axis=0))
    assert np.isinf(std[1]) and np.isinf(std[2]) and np.isfinite(std[[0, 3]]).all()


def test_a_site_with_one_training_row_gives_zeros_not_nan() -> None:
    x, y = _site(n=3)
    data = split_and_normalise(x, y, seed=0, feature_names=NAMES, fractions=(0.34, 0.33, 0.33))
    assert data.n_train == 1
    for part in (data.x_train, data.x_val, data.x_test):
        assert np.isfinite(part).all() and (part == 0).all()  # one row: every column is constant


def test_an_outlier_beyond_the_bound_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """A two-valued column is never clipped (splits.clip_bounds), so one extreme row still stands out and is
    named; with a third value the robust clip pulls the same unit error back to the train quantile."""
    n = 6000  # |z| <= sqrt(n - 1): a bound of 50 needs more than 2500 rows
    x, y = _site(n=n)
    x[:, 3] = 0.0
    x[0, 3] = 1e6  # a unit error in one row of a column otherwise 0
    with caplog.at_level(logging.WARNING):
        data = split_and_normalise(x, y, seed=0, feature_names=NAMES, fractions=(1.0, 0.0, 0.0),
                                   where="site H9")
    assert np.abs(data.x_train[:, 3]).max() > Z_WARN
    assert any("site H9" in r.getMessage() and "'noise'" in r.getMessage() for r in caplog.records)
    assert not any("'age'" in r.getMessage() for r in caplog.records)
    x[::2, 3] = 1e-3
    x[0, 3] = 1e6
    clipped = split_and_normalise(x, y, seed=0, feature_names=NAMES, fractions=(1.0, 0.0, 0.0), where="site H9")
    assert np.abs(clipped.x_train[:, 3]).max() < 2
    assert any(note.startswith("site H9: values far outside") and "(1 train, 0 val, 0 test): noise" in note
               for note in clipped.notes)


def test_registry_tables_and_icu_share_the_rule(tmp_path: Path) -> None:
    """Through a DataSpec (format table): the near-constant and the all-missing column are 0, noted."""
    path = tmp_path / "h.csv"
    x, y = _site(n=30)
    lines = ["age,ph,lactate,noise,label"]
    for row, label in zip(x, y, strict=True):
        lines.append(",".join("" if np.isnan(v) else repr(float(v)) for v in row) + f",{label}")
    path.write_text("\n".join(lines) + "\n")
    spec = {"label": "label", "numeric": list(NAMES)}
    data = load_site_data(DataSpec(format="table", path=path, options={"spec": spec}))
    cols = [data.feature_names.index(c) for c in ("ph", "lactate")]
    for part in (data.x_train, data.x_val, data.x_test):
        assert np.isfinite(part).all() and (part[:, cols] == 0).all()
    assert any("constant or missing" in n and "lactate" in n for n in data.notes)


def test_image_channel_constant_at_a_site_is_zero_and_named() -> None:
    """Images: a colour channel constant in train (up to rounding) is 0, not divided by ~1e-16."""
    from fedmqtt.data.base import BINARY
    from fedmqtt.data.registry import Dataset, _normaliser

    rng = np.random.default_rng(0)
    x = rng.random((20, 2, 4, 4)).astype(np.float32)
    x[:, 1] = np.float32(0.5)
    x[3, 1, 0, 0] = np.float32(0.5) + np.float32(6e-8)  # one float32 ulp: a spread of ~1e-8 of the value
    data = Dataset(x, (np.arange(20) % 2).astype(np.int64), BINARY, ("channel_0", "channel_1"), "image")
    norm, zeroed = _normaliser(data, np.arange(10), {}, [], "site")
    out = norm(np.arange(20))
    assert zeroed == ["channel_1"] and (out[:, 1] == 0).all() and np.isfinite(out).all()
    assert abs(float(out[:10, 0].std()) - 1) < 1e-3
