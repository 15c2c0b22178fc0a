"""Plausible ranges (unit errors become missing, counted in the site's notes) and robust clipping of every split
with bounds from the train split only."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from fedmqtt.data.physionet2012 import VARIABLES, IcuSet, without_implausible
from fedmqtt.data.plausible import PHYSIONET2012_RANGES, remove_out_of_range
from fedmqtt.data.registry import load_site_data
from fedmqtt.data.spec import DataSpec, Physionet2012Options
from fedmqtt.data.splits import clip_bounds, split_and_normalise, split_indices
from fedmqtt.data.tables import FeatureSpec

SPEC = {"label": "los", "task": "regression", "numeric": ["ph", "hr"], "ranges": {"ph": [6.5, 8.0]}}


def test_feature_spec_ranges_are_validated() -> None:
    FeatureSpec.model_validate(SPEC)
    for bad, message in (({"temp": [25, 45]}, "not one of the numeric columns"),
                         ({"ph": [8.0, 6.5]}, "low < high"),
                         ({"ph": [6.5, math.inf]}, "finite"),
                         ({"ph": [6.5]}, "ranges.ph")):
        with pytest.raises(ValidationError, match=message):
            FeatureSpec.model_validate({**SPEC, "ranges": bad})


def test_physionet_options_default_ranges_and_checks() -> None:
    opts = Physionet2012Options()
    assert opts.ranges["pH"] == (6.5, 8.0) and opts.ranges["HR"] == (0.0, 300.0)
    assert opts.ranges["Temp"] == (25.0, 45.0) and set(opts.ranges) == set(PHYSIONET2012_RANGES)
    assert Physionet2012Options(ranges={}).ranges == {}
    with pytest.raises(ValidationError, match="not one of the PhysioNet 2012 variables"):
        Physionet2012Options(ranges={"Ph": [6.5, 8.0]})
    assert Physionet2012Options(target="los").log_scale and not Physionet2012Options().log_scale
    assert not Physionet2012Options(target="los", log_target=False).log_scale
    with pytest.raises(ValidationError, match="log_target"):
        Physionet2012Options(target="mortality", log_target=True)


def test_remove_out_of_range_counts_per_item() -> None:
    x = np.array([[7.4, 80.0], [735.0, 90.0], [np.nan, 3000.0], [6.5, 300.0]])
    cleaned, removed = remove_out_of_range(x, ("ph", "hr"), {"ph": (6.5, 8.0), "hr": (0.0, 300.0)})
    assert np.isnan(cleaned[1, 0]) and np.isnan(cleaned[2, 1]) and cleaned[3, 0] == 6.5 and cleaned[3, 1] == 300
    assert removed["ph"].tolist() == [0, 1, 0, 0] and removed["hr"].tolist() == [0, 0, 1, 0]
    assert x[1, 0] == 735.0  # the input is not modified


def test_table_site_notes_count_what_the_ranges_removed(tmp_path: Path) -> None:
    rows = ["ph,hr,los"] + [f"{7.3 + k / 100},{70 + k},{k + 1}" for k in range(12)] + ["735,80,3", "7.2,-5,2"]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    spec = {**SPEC, "ranges": {"ph": [6.5, 8.0], "hr": [0, 300]}}
    site = load_site_data(DataSpec(format="table", path=tmp_path / "t.csv", options={"spec": spec}))
    note = [n for n in site.notes if "outside the plausible range" in n]
    assert note == [f"site file {tmp_path / 't.csv'}: 2 value(s) outside the plausible range set to missing: "
                    "hr 1, ph 1"]
    assert not np.isnan(site.x_train).any() and np.abs(site.x_test).max() < 10


def _icu(values: np.ndarray, observed: np.ndarray, static: np.ndarray) -> IcuSet:
    n = values.shape[0]
    return IcuSet(np.arange(n), values, observed, static, np.ones(n, np.int64), np.zeros(n), np.ones(n))


def test_icu_removed_measurement_carries_the_last_plausible_value() -> None:
    """pH 735 at hour 5: that hour is unobserved now and the hour-2 value 7.3 is carried to hour 47."""
    ph, hr = VARIABLES.index("pH"), VARIABLES.index("HR")
    values = np.full((1, 48, 37), np.nan, np.float32)
    observed = np.zeros((1, 48, 37), bool)
    observed[0, [2, 5], ph] = True
    observed[0, 0, hr] = True
    values[0, 2:5, ph], values[0, 5:, ph] = 7.3, 735.0  # as _carry_forward leaves them
    values[0, :, hr] = 80.0
    static = np.array([[60.0, 1.0, 13.0, 80.0, 0.0, 0.0, 1.0, 0.0]])  # Height 13 cm: a unit error
    clean, removed = without_implausible(_icu(values, observed, static), PHYSIONET2012_RANGES)
    assert removed["pH"].tolist() == [1] and removed["Height"].tolist() == [1] and set(removed) == {"pH", "Height"}
    assert not clean.observed[0, 5, ph] and clean.observed[0, 2, ph]
    assert np.all(clean.values[0, 2:, ph] == np.float32(7.3)) and np.isnan(clean.values[0, :2, ph]).all()
    assert np.all(clean.values[0, :, hr] == 80.0) and np.isnan(clean.static[0, 2]) and clean.static[0, 0] == 60
    assert values[0, 5, ph] == 735.0  # the input set is not modified


def test_a_unit_error_in_test_only_gives_a_bounded_z() -> None:
    """The case behind a test |z| of 15,882: pH 735 in one TEST row of a small site, with no range to catch it.

    Clipping to the train split's bounds keeps every held-out |z| within the train split's largest, itself at
    most sqrt(n_train - 1); without the clip the value would sit about 15,000 standard deviations out."""
    rng = np.random.default_rng(0)
    n = 15
    x = np.column_stack([rng.normal(7.38, 0.05, n), rng.normal(80, 10, n)])
    y = np.arange(n) % 2
    test_rows = split_indices(y, seed=0, fractions=(0.6, 0.2, 0.2))[2]
    x[test_rows[0], 0] = 735.0
    site = split_and_normalise(x, y, seed=0, feature_names=("pH", "HR"))
    train_sd = np.std(x[np.setdiff1d(np.arange(n), test_rows), 0])
    assert (735.0 - 7.38) / train_sd > 10_000  # what an unclipped standardisation would give
    bound = math.sqrt(site.n_train - 1)
    assert np.abs(site.x_test).max() <= bound + 1e-6 and np.abs(site.x_val).max() <= bound + 1e-6
    assert np.abs(site.x_test).max() <= np.abs(site.x_train).max() + 1e-6
    assert "site: values far outside the train split's 0.5-99.5 % quantiles clipped to them (0 train, 0 val, " \
           "1 test): pH" in site.notes


def test_clip_bounds_leave_binary_and_one_hot_columns_alone() -> None:
    """A rare 0/1 column keeps its ones (a quantile would erase them); a continuous column is clipped."""
    x = np.zeros((400, 2))
    x[0, 0] = 1.0  # one positive in 400
    x[:, 1] = np.arange(400)
    low, high = clip_bounds(x)
    assert low[0] == -np.inf and high[0] == np.inf
    assert 0 < low[1] < 3 and 396 < high[1] < 399


def test_icu_site_clips_every_split_with_train_bounds(tmp_path: Path) -> None:
    """Through the registry: an ICU stay whose test values lie far outside train is bounded like train."""
    folder = tmp_path / "set-a"
    folder.mkdir()
    for k in range(10):
        weight = 70 + k + 1000 * (k == 9)  # 1079 kg: a unit error the range removes
        (folder / f"{k:06d}.txt").write_text(
            f"Time,Parameter,Value\n00:00,RecordID,{1000 + k}\n00:00,Age,{50 + k}\n00:00,Weight,{weight}\n"
            f"00:00,ICUType,2\n01:00,Glucose,{100 + k}\n02:00,HR,{70 + 3 * k}\n")
    (tmp_path / "Outcomes-a.txt").write_text("RecordID,SAPS-I,SOFA,Length_of_stay,Survival,In-hospital_death\n"
                                             + "".join(f"{1000 + k},1,1,{k + 1},-1,0\n" for k in range(10)))
    spec = DataSpec(format="physionet2012", path=folder, options={"target": "los"}, fractions=(0.6, 0.2, 0.2))
    site = load_site_data(spec)
    assert any("Weight 1" in n and "outside the plausible range" in n for n in site.notes)  # 1070 kg removed
    bound = math.sqrt(site.n_train * 48 - 1)
    assert np.abs(site.x_test).max() <= bound and np.abs(site.x_val).max() <= bound
