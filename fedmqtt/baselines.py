"""Metric-optimal constant predictors: the number a model has to beat on each metric (numpy only).

A model that does not beat the best constant for a metric has learnt nothing the metric can see. The
best constant differs per metric, so one "baseline" is not enough: the training mean is optimal for MSE,
but for MAE it is the median and for MSLE the geometric-type mean expm1(mean(log1p y)). Each constant is
fitted on training targets only and predicted for every test row.

Ranking metrics (AUROC, AUPRC, balanced accuracy) have no best constant: every constant scores AUROC 0.5,
balanced accuracy 0.5 and AUPRC the test prevalence, so a model's AUROC is compared with 0.5 itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedmqtt.data.base import TaskInfo

# What every constant scores on these, whatever its value: a constant is no model there.
RANKING_METRICS: tuple[str, ...] = ("auroc", "auprc", "balanced_accuracy")
RANKING_NOTE = ("AUROC of any constant is 0.5 (balanced accuracy 0.5, AUPRC the test prevalence): no constant "
                "is a reference there, compare AUROC with 0.5")


@dataclass(frozen=True)
class Constant:
    """One metric-optimal constant fitted on training targets.

    `value`: a 0-d array (binary prevalence, regression level) or one value per class / label.
    `metrics`: the metric names (fedmqtt.metrics) it is optimal for.
    """

    metrics: tuple[str, ...]
    name: str  # how the report names those metrics: "MSE", "log-loss and accuracy"
    formula: str
    value: np.ndarray
    kind: str  # the task kind, so `predict` shapes scores like fedmqtt.training.evaluate.predict

    def describe(self) -> str:
        return f"best constant for {self.name}: {self.formula} = {format_value(self.value)}"

    def predict(self, n: int) -> np.ndarray:
        """Scores for n rows: (n,) for binary and regression, (n, C) for multiclass and multilabel."""
        if self.kind in ("binary", "regression"):
            return np.full(n, float(self.value), dtype=np.float64)
        return np.tile(np.asarray(self.value, dtype=np.float64), (n, 1))


def format_value(value: np.ndarray) -> str:
    flat = np.asarray(value, dtype=np.float64).reshape(-1)
    if flat.size == 1:
        return f"{flat[0]:.4g}"
    shown = ", ".join(f"{v:.3g}" for v in flat[:6])
    return f"[{shown}{', ...' if flat.size > 6 else ''}]"


def smoothed_prevalence(y: np.ndarray) -> np.ndarray:
    """Per column of 0/1 labels (NaN = not annotated): (positives + 1) / (annotated + 2).

    The maximum-likelihood prevalence k / n is 0 or 1 when a label has no positive (or no negative) in
    training, and one such test record then costs ~35 nats of log-loss; add-one smoothing keeps it inside
    (0, 1) at a cost of O(1/n) elsewhere. A 1-D y gives a 0-d result.
    """
    arr = np.asarray(y, dtype=np.float64)
    annotated = ~np.isnan(arr)
    positives = np.where(annotated, arr, 0.0).sum(axis=0)
    return (positives + 1.0) / (annotated.sum(axis=0) + 2.0)


def smoothed_class_frequencies(y: np.ndarray, n_classes: int) -> np.ndarray:
    """(count_c + 1) / (n + C): the log-loss-optimal constant, never 0; its argmax is the majority class."""
    counts = np.bincount(np.asarray(y, dtype=np.int64).reshape(-1), minlength=n_classes)[:n_classes]
    return (counts + 1.0) / (counts.sum() + n_classes)


def log_mean(y: np.ndarray) -> float:
    """expm1(mean(log1p y)): MSLE's best constant (MSLE is MSE on log1p, whose best constant is the mean)."""
    return float(np.expm1(np.mean(np.log1p(y))))


def weighted_median(y: np.ndarray, weights: np.ndarray) -> float:
    """The smallest y whose cumulative weight reaches half the total: minimises sum(w * |y - c|)."""
    order = np.argsort(y, kind="stable")
    cumulative = np.cumsum(weights[order])
    return float(y[order][np.searchsorted(cumulative, cumulative[-1] / 2.0)])


def mape_constant(y: np.ndarray) -> float:
    """MAPE's best constant: the median of y weighted by 1 / max(|y|, eps), the denominator MAPE uses."""
    return weighted_median(y, 1.0 / np.maximum(np.abs(y), np.finfo(np.float64).eps))


_REGRESSION: tuple[tuple[tuple[str, ...], str, str, Callable[[np.ndarray], float]], ...] = (
    (("mse",), "MSE", "mean y", lambda y: float(np.mean(y))),
    (("mae",), "MAE", "median y", lambda y: float(np.median(y))),
    (("msle",), "MSLE", "expm1(mean log1p y)", log_mean),
    (("mape",), "MAPE", "median y weighted by 1/|y|", mape_constant),
)


def metric_optimal_constants(task: TaskInfo, y_train: np.ndarray) -> list[Constant]:
    """Every metric-optimal constant for `task` fitted on `y_train` (the pooled training targets).

    Classification has one: the smoothed prevalence (binary, per label for multilabel over annotated
    entries) or class frequencies (multiclass) minimise log-loss and, thresholded or arg-maxed, are the
    majority class, which maximises accuracy. Regression has one per metric (MSLE only for targets >= 0).
    Empty when there are no training targets.
    """
    y = np.asarray(y_train)
    if task.kind == "regression":
        y = y.astype(np.float64).reshape(-1)
        y = y[np.isfinite(y)]
        if y.size == 0:
            return []
        rules = [r for r in _REGRESSION if r[0] != ("msle",) or y.min() >= 0]
        return [Constant(metrics, name, formula, np.asarray(fit(y)), task.kind)
                for metrics, name, formula, fit in rules]
    if y.shape[0] == 0:
        return []
    names = ("loss", "accuracy")
    if task.kind == "multiclass":
        value = smoothed_class_frequencies(y, task.n_outputs)
        formula = f"class frequencies (k_c+1)/(n+C), argmax class {int(value.argmax())}"
        return [Constant(names, "log-loss and accuracy", formula, value, task.kind)]
    if task.kind == "multilabel":
        formula = "per-label prevalence (k+1)/(n+2) over annotated entries"
        return [Constant(names, "log-loss and accuracy", formula, smoothed_prevalence(y), task.kind)]
    formula = "training prevalence (k+1)/(n+2), so the majority class at threshold 0.5"
    return [Constant(names, "log-loss and accuracy", formula, smoothed_prevalence(y.reshape(-1)), task.kind)]
