"""Per-site train/val/test split, then imputation and standardisation from the site's own train split."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from sklearn.model_selection import train_test_split

from fedmqtt.data.base import BINARY, TaskInfo
from fedmqtt.data.heart_disease import FEATURE_NAMES
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
) -> SiteData:
    """Split one site's rows and normalise them with statistics of its train split only.

    Args:
        x: raw features `(n, d)`, NaN where missing.
        y: integer labels `(n,)`.
        seed: seeds the split (`random_state` of `train_test_split`).
        fractions: train/val/test fractions; they must sum to 1 (val or test may be 0).
        feature_names: `d` column names carried along for reporting.

    Returns:
        A `SiteData`: train medians fill missing values, train mean/std standardise every split,
        so val and test rows never influence the statistics.

    Raises:
        DataError: shapes disagree, fractions are invalid, or the site has too few rows to split.
    """
    x, y = _check_inputs(x, y, fractions, feature_names)
    notes: list[str] = []
    idx = np.arange(y.shape[0])
    train_val, test = _split_off(idx, y, fractions[2], seed, notes, "test")
    rest = fractions[0] + fractions[1]
    train, val = _split_off(train_val, y, fractions[1] / rest, seed, notes, "val")
    fill, mean, std = _train_statistics(x[train])

    def norm(rows: np.ndarray) -> np.ndarray:
        part = np.where(np.isnan(x[rows]), fill, x[rows])
        return ((part - mean) / std).astype(np.float32)

    return SiteData(
        x_train=norm(train), y_train=y[train],
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
    """Per-column (median fill, mean, std) of 2-D train rows, NaN-aware (the rule of split_and_normalise)."""
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
            kept, held = train_test_split(idx, test_size=fraction, random_state=seed, stratify=stratify)
        except ValueError as exc:  # e.g. fewer held-out rows than classes: a random split still works
            if stratify is None:
                raise
            notes.append(f"{what} split not stratified: {exc}")
            log.warning("%s", notes[-1])
            kept, held = train_test_split(idx, test_size=fraction, random_state=seed)
    except ValueError as exc:
        raise DataError(f"cannot make the {what} split from {len(idx)} rows: {exc}") from exc
    return np.sort(kept), np.sort(held)


def _train_statistics(x_train: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-column fill value (median), mean and std of the imputed train rows."""
    observed = ~np.isnan(x_train)
    fill = np.zeros(x_train.shape[1])
    mean = np.zeros(x_train.shape[1])
    std = np.ones(x_train.shape[1])
    for j in range(x_train.shape[1]):
        col = x_train[observed[:, j], j]
        if col.size == 0:
            continue  # all-missing in train: fill 0, mean 0, std 1 gives 0 after standardising
        fill[j] = np.median(col)
        imputed = np.where(observed[:, j], x_train[:, j], fill[j])
        mean[j] = imputed.mean()
        sd = imputed.std()
        std[j] = sd if sd > 0 else 1.0  # a constant column would divide by zero
    return fill, mean, std
