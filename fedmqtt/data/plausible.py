"""Plausible ranges: a value outside its column's [low, high] is a unit error or an impossible reading, and
becomes missing (NaN) before anything else sees it; the imputation then treats it like any value never
recorded. Each item keeps a count of what was removed, so a site's notes can say how much of its own data
was set aside, per column (docs/data-preparation.md).

The ranges are wide on purpose: they remove what cannot be a measurement of a living patient in the stated
unit (pH 735, a heart rate of 3,000), never an extreme but real value; the robust clipping of
fedmqtt.data.splits deals with those.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

Range = tuple[float, float]
# Per item, per column: how many values fell outside the column's range (one per item for tables; the hours
# whose measurement was removed for ICU stays).
RemovedCounts = dict[str, np.ndarray]


def check_ranges(ranges: Mapping[str, Sequence[float]], columns: Iterable[str], *, what: str) -> dict[str, Range]:
    """`ranges` as {column: (low, high)}, each column one of `columns`, low < high, both finite.

    Raises:
        ValueError: an unknown column, a pair that is not two numbers, a bound that is not finite, or
            low >= high; the message names the column (`what` names the columns' kind).
    """
    known = set(columns)
    out: dict[str, Range] = {}
    for name, pair in ranges.items():
        if name not in known:
            raise ValueError(f"range for {name!r}, which is not one of the {what}: {sorted(known)}")
        if isinstance(pair, (str, bytes)) or len(pair) != 2:
            raise ValueError(f"range for {name!r} must be [low, high], got {pair!r}")
        low, high = (float(v) for v in pair)
        if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
            raise ValueError(f"range for {name!r} must be finite with low < high, got [{low:g}, {high:g}]")
        out[name] = (low, high)
    return out


def outside(values: np.ndarray, bounds: Range) -> np.ndarray:
    """True where a value is present (not NaN) and below low or above high; the bounds themselves are in."""
    low, high = bounds
    with np.errstate(invalid="ignore"):
        return ~np.isnan(values) & ((values < low) | (values > high))


def remove_out_of_range(x: np.ndarray, names: Sequence[str], ranges: Mapping[str, Range]
                        ) -> tuple[np.ndarray, RemovedCounts]:
    """A copy of `x` (items first, columns on the last axis, named `names`) with out-of-range values NaN.

    Returns the cleaned copy and, for every ranged column that lost a value, per-item counts of the values
    removed (summed over any middle axes, e.g. hours).
    """
    x = np.array(x, copy=True)
    removed: RemovedCounts = {}
    for name, bounds in ranges.items():
        if name not in names:
            continue
        j = list(names).index(name)
        bad = outside(x[..., j], bounds)
        if bad.any():
            x[..., j] = np.where(bad, np.nan, x[..., j])
            removed[name] = bad.reshape(bad.shape[0], -1).sum(axis=1).astype(np.int32)
    return x, removed


def removed_note(removed: Mapping[str, np.ndarray], where: str) -> str | None:
    """One line for a site's notes: per column, the values outside the plausible range set to missing."""
    totals = {name: int(np.sum(counts)) for name, counts in removed.items()}
    shown = [f"{name} {n}" for name, n in sorted(totals.items()) if n]
    if not shown:
        return None
    return (f"{where}: {sum(totals.values())} value(s) outside the plausible range set to missing: "
            f"{', '.join(shown)}")


# PhysioNet/CinC 2012, in the challenge's units: what a living adult ICU patient can show, from general
# clinical plausibility (physiology and the ranges laboratories can report), chosen wide so that only unit
# errors and impossible readings fall outside. The ICU-type one-hot, Gender and MechVent need no range.
PHYSIONET2012_RANGES: dict[str, Range] = {
    "ALP": (1.0, 5000.0),          # IU/L
    "ALT": (1.0, 20000.0),         # IU/L (shock liver reaches the thousands)
    "AST": (1.0, 30000.0),         # IU/L
    "Albumin": (0.5, 7.0),         # g/dL
    "BUN": (1.0, 300.0),           # mg/dL
    "Bilirubin": (0.05, 80.0),     # mg/dL
    "Cholesterol": (20.0, 1000.0),  # mg/dL
    "Creatinine": (0.1, 25.0),     # mg/dL
    "DiasABP": (5.0, 200.0),       # mmHg, invasive
    "FiO2": (0.21, 1.0),           # a fraction: 21 % (room air) to 100 %; a percentage is a unit error
    "GCS": (3.0, 15.0),            # the scale's own bounds
    "Glucose": (10.0, 1500.0),     # mg/dL
    "HCO3": (2.0, 60.0),           # mmol/L
    "HCT": (5.0, 75.0),            # %
    "HR": (0.0, 300.0),            # beats per minute
    "K": (1.0, 12.0),              # mmol/L
    "Lactate": (0.1, 40.0),        # mmol/L
    "MAP": (10.0, 250.0),          # mmHg, invasive
    "Mg": (0.3, 10.0),             # the challenge's magnesium unit
    "NIDiasABP": (5.0, 200.0),     # mmHg, cuff
    "NIMAP": (10.0, 250.0),        # mmHg, cuff
    "NISysABP": (20.0, 300.0),     # mmHg, cuff
    "Na": (90.0, 200.0),           # mmol/L
    "PaCO2": (5.0, 200.0),         # mmHg
    "PaO2": (10.0, 800.0),         # mmHg (hyperbaric values excluded)
    "Platelets": (1.0, 2000.0),    # 1000/uL
    "RespRate": (0.0, 100.0),      # breaths per minute (0 while ventilated without spontaneous breaths)
    "SaO2": (20.0, 100.0),         # %
    "SysABP": (20.0, 300.0),       # mmHg, invasive
    "Temp": (25.0, 45.0),          # degrees Celsius
    "TroponinI": (0.0, 500.0),     # ug/L
    "TroponinT": (0.0, 100.0),     # ug/L
    "Urine": (0.0, 10000.0),       # mL per recorded output
    "WBC": (0.05, 500.0),          # 1000/uL
    "Weight": (20.0, 350.0),       # kg (the static descriptor and the measurements)
    "pH": (6.5, 8.0),              # blood pH
    "Age": (0.0, 120.0),           # years
    "Height": (100.0, 250.0),      # cm
}  # fmt: skip
