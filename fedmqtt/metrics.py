"""Binary classification metrics over a whole split, with None and a reason where undefined."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from sklearn.metrics import (
    accuracy_score,
    average_precision_score,
    balanced_accuracy_score,
    log_loss,
    roc_auc_score,
)

METRIC_NAMES: tuple[str, ...] = ("auroc", "auprc", "accuracy", "balanced_accuracy", "loss")
# Probabilities are clipped before the log so a confident wrong prediction costs ~34.5, not inf.
_EPS = 1e-15


def binary_metrics(
    y_true: np.ndarray, score: np.ndarray, *, threshold: float = 0.5
) -> tuple[dict[str, float | None], dict[str, str]]:
    """Metrics of positive-class probabilities `score` against 0/1 labels `y_true`.

    AUROC, AUPRC (average precision) and balanced accuracy need both classes in the split; with
    one class they are None (AP would be trivially 1 or undefined, balanced accuracy would just be
    accuracy). Accuracy and loss (binary cross-entropy) are defined for any non-empty split.

    Returns:
        `(values, reasons)`: every name in `METRIC_NAMES` maps to a python float or None, and
        `reasons` says why for each None.

    Raises:
        ValueError: shapes differ, or labels are not 0/1.
    """
    y = np.asarray(y_true).reshape(-1)
    p = np.asarray(score, dtype=np.float64).reshape(-1)
    if y.shape != p.shape:
        raise ValueError(f"{y.shape[0]} labels but {p.shape[0]} scores")
    if y.size and not np.isin(y, (0, 1)).all():
        raise ValueError(f"labels must be 0/1, got values {sorted(set(np.unique(y).tolist()))}")
    y = y.astype(np.int64)
    n = int(y.size)
    if n == 0:
        return _all_none("empty split (n=0)")
    if not np.isfinite(p).all():
        return _all_none(f"scores contain NaN or inf ({int((~np.isfinite(p)).sum())} of n={n})")
    values: dict[str, float | None] = dict.fromkeys(METRIC_NAMES)
    reasons: dict[str, str] = {}
    pred = (p >= threshold).astype(np.int64)
    values["accuracy"] = float(accuracy_score(y, pred))
    clipped = np.clip(p, _EPS, 1.0 - _EPS)
    values["loss"] = float(log_loss(y, clipped, labels=[0, 1]))
    classes = np.unique(y)
    if classes.size < 2:
        which = "positive" if classes[0] == 1 else "negative"
        for name in ("auroc", "auprc", "balanced_accuracy"):
            reasons[name] = f"only one class ({which}) in this split (n={n})"
        return values, reasons
    values["auroc"] = float(roc_auc_score(y, p))
    values["auprc"] = float(average_precision_score(y, p))
    # labels=[0, 1] is implicit: both classes are in y_true, so sklearn does not warn.
    values["balanced_accuracy"] = float(balanced_accuracy_score(y, pred))
    return values, reasons


def mean_defined(values: Iterable[float | None]) -> float | None:
    """Unweighted mean of the values that are not None (None if there are none)."""
    defined = [float(v) for v in values if v is not None]
    return sum(defined) / len(defined) if defined else None


def _all_none(reason: str) -> tuple[dict[str, float | None], dict[str, str]]:
    return dict.fromkeys(METRIC_NAMES), dict.fromkeys(METRIC_NAMES, reason)
