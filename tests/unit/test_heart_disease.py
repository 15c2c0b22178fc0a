"""Parsing the bundled UCI heart-disease files into the fixed 15-feature matrix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedmqtt.data.heart_disease import FEATURE_NAMES, SITES, bundled_path, load_site_file
from fedmqtt.errors import DataError

GOOD_ROW = "63,1,1,145,233,1,2,150,0,2.3,3,0,6,0"


@pytest.mark.parametrize(
    ("site", "rows", "positives"),
    [("cleveland", 303, 139), ("hungary", 294, 106), ("switzerland", 123, 115), ("va", 200, 149)],
)
def test_bundled_site_sizes_and_positives(site: str, rows: int, positives: int) -> None:
    """Each bundled site parses to its documented row count, 15 features and positive count."""
    x, y = load_site_file(bundled_path(site))
    assert x.shape == (rows, 15) and x.dtype == np.float64
    assert y.dtype == np.int64 and int(y.sum()) == positives
    assert set(np.unique(y).tolist()) <= {0, 1}


def test_feature_names_are_fixed() -> None:
    """The feature spec is a fixed 15-name vocabulary, identical for every site."""
    assert len(FEATURE_NAMES) == 15
    assert FEATURE_NAMES[:8] == ("age", "trestbps", "chol", "thalach", "oldpeak", "sex", "fbs", "exang")
    assert FEATURE_NAMES[8:] == ("cp_1", "cp_2", "cp_3", "cp_4", "restecg_0", "restecg_1", "restecg_2")
    assert SITES == ("cleveland", "hungary", "switzerland", "va")


def test_zero_cholesterol_and_pressure_are_missing() -> None:
    """chol == 0 and trestbps == 0 become NaN (all Switzerland chol; VA 49 + 7 chol, 56 + 1 trestbps)."""
    x_ch, _ = load_site_file(bundled_path("switzerland"))
    x_va, _ = load_site_file(bundled_path("va"))
    chol, trestbps = FEATURE_NAMES.index("chol"), FEATURE_NAMES.index("trestbps")
    assert np.isnan(x_ch[:, chol]).all()
    assert int(np.isnan(x_va[:, chol]).sum()) == 56
    assert int(np.isnan(x_va[:, trestbps]).sum()) == 57


def test_one_hot_is_nan_when_category_missing(tmp_path: Path) -> None:
    """A missing cp makes all four cp_* columns NaN; a present one is exactly one-hot."""
    path = tmp_path / "f.data"
    path.write_text(GOOD_ROW + "\n" + "40,0,?,120,200,0,0,150,0,0,?,?,?,1\n")
    x, y = load_site_file(path)
    cp = [FEATURE_NAMES.index(f"cp_{v}") for v in (1, 2, 3, 4)]
    assert x[0, cp].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert np.isnan(x[1, cp]).all()
    assert y.tolist() == [0, 1]


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        ("63,1,1,145,233,1,2,150,0,2.3,3,0,6", ["line 2", "expected 14"]),
        ("63,1,1,abc,233,1,2,150,0,2.3,3,0,6,0", ["line 2", "column 4 (trestbps)", "'abc'"]),
        ("63,1,7,145,233,1,2,150,0,2.3,3,0,6,0", ["line 2", "column 3 (cp)", "unknown category 7"]),
        ("63,1,1,145,233,1,5,150,0,2.3,3,0,6,0", ["line 2", "column 7 (restecg)"]),
        ("63,1,1,145,233,1,2,150,0,2.3,3,0,6,?", ["line 2", "column 14 (num)", "missing label"]),
    ],
)
def test_malformed_file_names_file_line_column(tmp_path: Path, bad_line: str, expected: list[str]) -> None:
    """A malformed row raises DataError naming the file, the line number and the column."""
    path = tmp_path / "bad.data"
    path.write_text(f"{GOOD_ROW}\n{bad_line}\n")
    with pytest.raises(DataError) as info:
        load_site_file(path)
    message = str(info.value)
    assert str(path) in message
    for part in expected:
        assert part in message


def test_missing_file_and_unknown_site_raise_data_error(tmp_path: Path) -> None:
    """An absent file or an unknown site id is a DataError, not an OSError/KeyError."""
    with pytest.raises(DataError, match="cannot read"):
        load_site_file(tmp_path / "absent.data")
    with pytest.raises(DataError, match="known sites"):
        bundled_path("mars")
