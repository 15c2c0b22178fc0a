"""The scores fedmqtt.metrics is made of, in numpy alone: AUROC, average precision, accuracies, losses, errors.

Each gives the value scikit-learn's function of the same name gave (tests/unit/test_scoring.py compares them on
random inputs, ties included), so every metric recorded so far stays the same. They exist because a site
validates every round, and importing scikit-learn costs a site process about a CPU second (it imports
scipy.stats and pandas) for these few lines of arithmetic.

Inputs are checked by the callers in fedmqtt.metrics (shapes, label values, finiteness, both classes present
where a score needs them); these functions assume it.
"""

from __future__ import annotations

import numpy as np


def accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Share of predictions equal to the label."""
    return float(np.mean(np.asarray(y_true) == np.asarray(y_pred)))


def macro_recall(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Mean over the classes present in `y_true` of the share of their rows predicted as that class
    (balanced accuracy; scikit-learn's `balanced_accuracy_score`, and `recall_score(average="macro")` over
    the classes present)."""
    y, pred = np.asarray(y_true), np.asarray(y_pred)
    classes, inverse, support = np.unique(y, return_inverse=True, return_counts=True)
    hits = np.bincount(inverse[y == pred], minlength=classes.size)
    return float(np.mean(hits / support))


def binary_log_loss(y_true: np.ndarray, p_positive: np.ndarray) -> float:
    """Mean binary cross-entropy of 0/1 labels against positive-class probabilities inside (0, 1)."""
    y = np.asarray(y_true)
    p = np.asarray(p_positive, dtype=np.float64)
    return float(np.mean(-np.log(np.where(y == 1, p, 1.0 - p))))


def _curve(y_true: np.ndarray, score: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(true positives, false positives) above each distinct score, scores taken from the highest down.

    Equal scores are one threshold; the sort is stable, so equal scores keep a fixed order (the counts at a
    threshold do not depend on it)."""
    order = np.argsort(np.asarray(score), kind="mergesort")[::-1]
    s = np.asarray(score)[order]
    y = np.asarray(y_true, dtype=np.float64)[order]
    last_of_each = np.r_[np.nonzero(np.diff(s))[0], y.size - 1]
    tps = np.cumsum(y)[last_of_each]
    return tps, 1 + last_of_each - tps


def roc_auc(y_true: np.ndarray, score: np.ndarray) -> float:
    """Area under the ROC curve by the trapezoidal rule; both classes must be present.

    Points on a straight line between their neighbours are dropped first (they add no area; dropping them
    keeps the float sum the one scikit-learn makes)."""
    tps, fps = _curve(y_true, score)
    if tps.size > 2:
        corner = np.r_[True, np.logical_or(np.diff(fps, 2), np.diff(tps, 2)), True]
        tps, fps = tps[corner], fps[corner]
    tps, fps = np.r_[0, tps], np.r_[0, fps]
    return float(np.trapezoid(tps / tps[-1], fps / fps[-1]))


def average_precision(y_true: np.ndarray, score: np.ndarray) -> float:
    """Sum over thresholds of precision x the rise in recall (no interpolation); a positive must be present."""
    tps, fps = _curve(y_true, score)
    precision = np.r_[(tps / (tps + fps))[::-1], 1.0]
    recall = np.r_[(tps / tps[-1])[::-1], 0.0]
    return float(-np.sum(np.diff(recall) * precision[:-1]))


def mean_absolute_error(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    return float(np.mean(np.abs(np.asarray(y_pred) - np.asarray(y_true))))


def mean_absolute_percentage_error(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """A fraction; the denominator is max(|y|, float64 eps), so a zero target gives a large finite term."""
    y = np.asarray(y_true)
    return float(np.mean(np.abs(np.asarray(y_pred) - y) / np.maximum(np.abs(y), np.finfo(np.float64).eps)))


def mean_squared_error(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    return float(np.mean((np.asarray(y_true) - np.asarray(y_pred)) ** 2))


def mean_squared_log_error(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Mean squared error of ln(1 + v); targets and predictions must be >= 0 (the caller checks)."""
    return mean_squared_error(np.log1p(y_true), np.log1p(y_pred))
