"""Per-site train/val/test split, then imputation and standardisation from the site's own train split."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fedmqtt.data.base import BINARY, TaskInfo
from fedmqtt.data.heart_disease import FEATURE_NAMES
from fedmqtt.data.shuffle_split import split_positions
from fedmqtt.errors import DataError
from fedmqtt.recruitment import label_histogram

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SiteData:
    """One site's normalised splits; x is float32 with the items on axis 0, y follows `task` (base.TaskInfo).

    Layout of x by format: tables (n, features); images (n, channels, height, width); 12-lead ECG
    (n, 12, samples); ICU stays (n, 48 hours, channels) with channels = 37 variables, then 37 observed
    masks when asked, then 8 static features repeated every hour (see fedmqtt.data.registry).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    feature_names: tuple[str, ...]
    # Human-readable remarks on how the split was made (e.g. why stratification was skipped).
    notes: tuple[str, ...] = field(default=())
    task: TaskInfo = BINARY
    # Per column: this site's values outside the plausible range, set to missing before the split
    # (fedmqtt.data.plausible); only columns that lost a value.
    out_of_range: dict[str, int] = field(default_factory=dict)

    @property
    def n_train(self) -> int:
        return int(self.y_train.shape[0])

    @property
    def n_val(self) -> int:
        return int(self.y_val.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.y_test.shape[0])

    def label_histogram(self) -> dict[str, int]:
        """Counts of each train label keyed "0", "1", ... (binary always has both); per-label positives for
        multilabel and length-of-stay bins for regression (fedmqtt.recruitment.label_histogram)."""
        return label_histogram(self.task.kind, self.y_train, self.task.n_outputs)


def split_and_normalise(
    x: np.ndarray,
    y: np.ndarray,
    *,
    seed: int,
    fractions: tuple[float, float, float] = (0.6, 0.2, 0.2),
    feature_names: Sequence[str] = FEATURE_NAMES,
    where: str = "site",
) -> SiteData:
    """Split one site's rows and normalise them with statistics of its train split only.

    Args:
        x: raw features `(n, d)`, NaN where missing.
        y: integer labels `(n,)`.
        seed: seeds the split (fedmqtt.data.shuffle_split: the rows scikit-learn's `train_test_split` drew).
        fractions: train/val/test fractions; they must sum to 1 (val or test may be 0).
        feature_names: `d` column names carried along for reporting.
        where: names the site in notes and warnings (e.g. its file).

    Returns:
        A `SiteData`: every split is first clipped to the train split's robust bounds (`clip_bounds`),
        then train medians fill missing values and train mean/std standardise every split,
        so val and test rows never influence the statistics. Columns constant or entirely missing in
        train are 0 in every split (`_train_statistics`); a training value beyond |z| = Z_WARN is
        logged and noted, naming the column and `where`.

    Raises:
        DataError: shapes disagree, fractions are invalid, or the site has too few rows to split.
    """
    x, y = _check_inputs(x, y, fractions, feature_names)
    notes: list[str] = []
    idx = np.arange(y.shape[0])
    train_val, test = _split_off(idx, y, fractions[2], seed, notes, "test")
    rest = fractions[0] + fractions[1]
    train, val = _split_off(train_val, y, fractions[1] / rest, seed, notes, "val")
    low, high = clip_bounds(x[train])
    if clipped := clipped_note({"train": x[train], "val": x[val], "test": x[test]}, low, high, where, feature_names):
        notes.append(clipped)
    x = clip(x, low, high)
    fill, mean, std = _train_statistics(x[train])
    if zeroed := constant_columns(std, feature_names):
        notes.append(f"{where}: constant or missing in train, set to 0: {', '.join(zeroed)}")
    x_train = standardise(x[train], fill, mean, std)
    notes.extend(warn_extreme(x_train, feature_names, where))

    def norm(rows: np.ndarray) -> np.ndarray:
        return standardise(x[rows], fill, mean, std)

    return SiteData(
        x_train=x_train, y_train=y[train],
        x_val=norm(val), y_val=y[val],
        x_test=norm(test), y_test=y[test],
        feature_names=tuple(feature_names), notes=tuple(notes),
    )  # fmt: skip


def split_indices(
    y: np.ndarray, *, seed: int, fractions: Sequence[float], stratify: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[str, ...]]:
    """Sorted (train, val, test) row indices as `split_and_normalise` makes them, plus notes.

    `stratify=False` for targets that cannot be stratified (multilabel, regression). Raises DataError
    when a split cannot be made.
    """
    if len(fractions) != 3 or fractions[0] <= 0 or min(fractions) < 0 or abs(sum(fractions) - 1) > 1e-6:
        raise DataError(f"fractions must be (train > 0, val >= 0, test >= 0) summing to 1, got {fractions}")
    if len(y) < 3:
        raise DataError(f"a site needs at least 3 rows to split, got {len(y)}")
    notes: list[str] = []
    strata = np.asarray(y) if stratify else np.zeros(len(y), dtype=np.int64)
    idx = np.arange(len(y))
    train_val, test = _split_off(idx, strata, fractions[2], seed, notes, "test")
    val_share = fractions[1] / (fractions[0] + fractions[1])
    train, val = _split_off(train_val, strata, val_share, seed, notes, "val")
    return train, val, test, tuple(notes)


def train_statistics(x_train: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-column (median fill, mean, std) of 2-D train rows, NaN-aware (the rule of split_and_normalise).

    std is inf for columns constant or all-missing in train: `standardise` makes them 0."""
    return _train_statistics(x_train)


def _check_inputs(
    x: np.ndarray, y: np.ndarray, fractions: Sequence[float], names: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y).astype(np.int64, copy=False)
    if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise DataError(f"features {x.shape} and labels {y.shape} do not describe the same rows")
    if x.shape[1] != len(names):
        raise DataError(f"{x.shape[1]} feature columns but {len(names)} feature names")
    if len(fractions) != 3 or fractions[0] <= 0 or min(fractions) < 0 or abs(sum(fractions) - 1) > 1e-6:
        raise DataError(f"fractions must be (train > 0, val >= 0, test >= 0) summing to 1, got {fractions}")
    if y.shape[0] < 3:
        raise DataError(f"a site needs at least 3 rows to split, got {y.shape[0]}")
    return x, y


def _split_off(
    idx: np.ndarray, y: np.ndarray, fraction: float, seed: int, notes: list[str], what: str
) -> tuple[np.ndarray, np.ndarray]:
    """Split `idx` into (kept, held-out `fraction`), stratified by label where each class has >= 2 rows."""
    if fraction <= 0:
        return idx, idx[:0]
    labels = y[idx]
    _, counts = np.unique(labels, return_counts=True)
    stratify: np.ndarray | None = labels
    if counts.min() < 2:
        stratify = None
        notes.append(
            f"{what} split not stratified: a class has {counts.min()} row(s) among {len(idx)} (needs >= 2)"
        )
        log.warning("%s", notes[-1])
    try:
        try:
            kept, held = split_positions(len(idx), fraction, seed, stratify)
        except ValueError as exc:  # e.g. fewer held-out rows than classes: a random split still works
            if stratify is None:
                raise
            notes.append(f"{what} split not stratified: {exc}")
            log.warning("%s", notes[-1])
            kept, held = split_positions(len(idx), fraction, seed)
    except ValueError as exc:
        raise DataError(f"cannot make the {what} split from {len(idx)} rows: {exc}") from exc
    return np.sort(idx[kept]), np.sort(idx[held])


# Robust clipping: every split is clipped to these quantiles of the train split's observed values, per column,
# before imputation and standardisation. A value the plausible ranges let through (a real but extreme reading,
# or a unit error inside a wide range) then cannot dominate the train statistics, and a val/test value can
# never lie beyond the train values: its |z| is at most the train split's largest, itself at most
# sqrt(n - 1) for n train values (population std). With few train values the bounds are close to the
# train minimum and maximum. Columns with fewer than CLIP_MIN_DISTINCT distinct train values (binary,
# one-hot, masks) are not clipped: a quantile of a rare 0/1 column would erase its ones.
CLIP_QUANTILES = (0.005, 0.995)
CLIP_MIN_DISTINCT = 3


def clip_bounds(x_train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column (last axis) of the train rows: the CLIP_QUANTILES of its observed values, or (-inf, inf)
    where the column has fewer than CLIP_MIN_DISTINCT distinct observed values."""
    flat = np.asarray(x_train, dtype=np.float64).reshape(-1, x_train.shape[-1])
    low = np.full(flat.shape[1], -np.inf)
    high = np.full(flat.shape[1], np.inf)
    for j in range(flat.shape[1]):
        col = flat[~np.isnan(flat[:, j]), j]
        if np.unique(col).size >= CLIP_MIN_DISTINCT:
            low[j], high[j] = np.quantile(col, CLIP_QUANTILES)
    return low, high


def clip(part: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """`part` with each column (last axis) clipped to [low, high]; NaN (missing) stays NaN."""
    return np.clip(np.asarray(part, dtype=np.float64), low, high)


def clipped_note(parts: dict[str, np.ndarray], low: np.ndarray, high: np.ndarray, where: str,
                 names: Sequence[str]) -> str | None:
    """One line for a site's notes about the values `clip` moved FAR: beyond the bounds by more than the
    bounds' own width (high - low), per split, naming the columns; None when there are none.

    Clipping the train split's outer 1 % and the held-out values just past them is routine and goes
    unmentioned; a value that far out is a unit error or an artefact worth a look (the pH 735 case)."""
    width = high - low
    counts: dict[str, int] = {}
    columns: set[str] = set()
    for split, part in parts.items():
        flat = np.asarray(part, dtype=np.float64).reshape(-1, part.shape[-1])
        with np.errstate(invalid="ignore"):
            far = (flat < low - width) | (flat > high + width)
        counts[split] = int(far.sum())
        columns.update(str(names[j]) for j in np.flatnonzero(far.any(axis=0)).tolist())
    if not any(counts.values()):
        return None
    lo, hi = (f"{100 * q:g}" for q in CLIP_QUANTILES)
    return (f"{where}: values far outside the train split's {lo}-{hi} % quantiles clipped to them ("
            + ", ".join(f"{n} {split}" for split, n in counts.items()) + f"): {', '.join(sorted(columns))}")


# A column whose spread is below this share of its magnitude is constant at this site. Rounding alone
# leaves a constant column of magnitude |m| with a float64 std of about 1e-16 * |m| (the case seen on
# real ICU tables), and dividing by that gives values of 1e16; clinical measurements vary far more than
# 1e-8 of their size, so the floor only ever catches rounding noise. max(1, |mean|) keeps the floor
# absolute (1e-8) for columns centred near 0.
RELATIVE_STD_FLOOR = 1e-8
# A standardised training value beyond this is logged: with the floor above it can only come from a
# genuine outlier (|z| <= sqrt(n - 1) for n rows), which the user should look at.
Z_WARN = 50.0


def is_constant(std: np.ndarray | float, mean: np.ndarray | float) -> np.ndarray:
    """True where a spread is too small to divide by: std < RELATIVE_STD_FLOOR * max(1, |mean|)."""
    return np.asarray(std) < RELATIVE_STD_FLOOR * np.maximum(1.0, np.abs(np.asarray(mean)))


def _train_statistics(x_train: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-column fill value (median), mean and scale of the imputed train rows.

    A column entirely missing in train, or constant there (see `is_constant`; one training row makes
    every column constant), carries no information at this site: it becomes 0 in EVERY split (scale
    inf), so a val/test value that differs from the train constant cannot reach the model unscaled.
    Columns are never dropped: every site must feed the shared model the same number of inputs.
    """
    observed = ~np.isnan(x_train)
    fill = np.zeros(x_train.shape[1])
    mean = np.zeros(x_train.shape[1])
    std = np.full(x_train.shape[1], np.inf)
    for j in range(x_train.shape[1]):
        col = x_train[observed[:, j], j]
        if col.size == 0:
            continue  # all-missing in train: 0 everywhere
        fill[j] = np.median(col)
        imputed = np.where(observed[:, j], x_train[:, j], fill[j])
        mean[j] = imputed.mean()
        sd = imputed.std()
        if not is_constant(sd, mean[j]):
            std[j] = sd
    return fill, mean, std


def standardise(part: np.ndarray, fill: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """(x - mean) / std with NaN filled first; constant and all-missing columns (std inf) give exactly 0."""
    part = np.where(np.isnan(part), fill, part)
    with np.errstate(invalid="ignore"):  # an infinite input over an infinite scale: still 0 below
        z = (part - mean) / std
    return np.where(np.isinf(std), 0.0, z).astype(np.float32)


def constant_columns(std: np.ndarray, names: Sequence[str]) -> list[str]:
    """Names of the columns `standardise` sets to 0 (constant or all-missing in train)."""
    return [str(names[j]) for j in np.flatnonzero(np.isinf(std)).tolist()]


def warn_extreme(z_train: np.ndarray, names: Sequence[str], where: str) -> list[str]:
    """Log (and return) one line per training feature whose standardised value exceeds Z_WARN."""
    flat = np.abs(z_train.reshape(-1, z_train.shape[-1])) if z_train.size else np.zeros((0, len(names)))
    lines = []
    for j in np.flatnonzero(flat.max(axis=0, initial=0.0) > Z_WARN).tolist():
        lines.append(f"{where}: standardised training feature {names[j]!r} reaches |z| = "
                     f"{float(flat[:, j].max()):.3g} (> {Z_WARN:g}); check that column for outliers or unit errors")
        log.warning("%s", lines[-1])
    return lines
