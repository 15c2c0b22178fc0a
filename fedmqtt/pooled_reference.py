"""The pooled reference model: what a central analyst would fit on every site's training rows (tables only).

A federated model that does not come near a plain linear model fitted on the pooled data has not reached
what the data allow; one that beats it by a wide margin is worth a second look. The rows are the sites'
own preprocessed rows (each site imputed and standardised with its own training statistics, as the
federated model sees them), so the reference and the model read the same inputs. scikit-learn, default
regularisation (L2, C = 1 or alpha = 1), deterministic given the seed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fedmqtt.baselines import smoothed_prevalence
from fedmqtt.data.base import TaskInfo

if TYPE_CHECKING:
    from sklearn.linear_model import LogisticRegression

MAX_ITER = 1000
SKEW_LIMIT = 1.0  # sample skewness above this: a non-negative target is modelled on log1p (lengths of stay)


@dataclass(frozen=True)
class PooledReference:
    what: str
    predict: Callable[[np.ndarray], np.ndarray]  # x -> scores shaped like fedmqtt.training.evaluate.predict


@dataclass(frozen=True)
class NotFitted:
    why: str


def fit_pooled_reference(task: TaskInfo, x: np.ndarray, y: np.ndarray, *, seed: int) -> PooledReference | NotFitted:
    """Logistic regression (binary; multinomial for multiclass; one per label for multilabel, over its
    annotated rows) or ridge regression (on log1p y for a skewed non-negative target, else on y) fitted on
    the pooled training rows `x`, `y`. NotFitted, with the reason, for images and signals (x with more
    than two axes: a linear model on raw pixels or samples is no meaningful reference) or too few labels.
    """
    if x.ndim != 2:
        return NotFitted(f"inputs are images or signals (each item of shape {tuple(x.shape[1:])}), not table "
                         "rows: a linear model on raw pixels or samples is no meaningful reference; a pooled run "
                         "of the same network is algorithm = \"central\"")
    if x.shape[0] < 2:
        return NotFitted("fewer than two pooled training rows")
    from sklearn.exceptions import ConvergenceWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        fitted = _fit(task, np.asarray(x, dtype=np.float64), np.asarray(y), seed)
    for w in caught:  # anything else goes on to the caller's filters
        if not issubclass(w.category, ConvergenceWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if isinstance(fitted, PooledReference) and any(issubclass(w.category, ConvergenceWarning) for w in caught):
        fitted = PooledReference(f"{fitted.what} (not converged in {MAX_ITER} iterations)", fitted.predict)
    return fitted


def _fit(task: TaskInfo, x: np.ndarray, y: np.ndarray, seed: int) -> PooledReference | NotFitted:
    from sklearn.linear_model import LogisticRegression

    def logistic() -> LogisticRegression:
        return LogisticRegression(max_iter=MAX_ITER, random_state=seed)  # lbfgs: multinomial for > 2 classes

    if task.kind == "regression":
        return _ridge(x, y.astype(np.float64).reshape(-1))
    if task.kind == "multilabel":
        return _per_label(x, y.astype(np.float64), logistic)
    labels = y.astype(np.int64).reshape(-1)
    present = np.unique(labels)
    if present.size < 2:
        return NotFitted(f"only one class ({int(present[0])}) in the pooled training rows")
    model = logistic().fit(x, labels)
    if task.kind == "binary":
        return PooledReference("logistic regression on the pooled training rows",
                               lambda rows: model.predict_proba(np.asarray(rows, np.float64))[:, 1])
    columns = model.classes_.astype(np.int64)

    def proba(rows: np.ndarray) -> np.ndarray:
        out = np.zeros((len(rows), task.n_outputs))  # classes absent from training get probability 0
        out[:, columns] = model.predict_proba(np.asarray(rows, np.float64))
        return out
    return PooledReference("multinomial logistic regression on the pooled training rows", proba)


def _per_label(x: np.ndarray, y: np.ndarray,
               logistic: Callable[[], LogisticRegression]) -> PooledReference:
    """One logistic regression per label over its annotated rows; a label with one class annotated (or none)
    predicts its smoothed prevalence."""
    levels: dict[int, float] = {}  # labels with one class annotated (or none): their smoothed prevalence
    models: dict[int, LogisticRegression] = {}
    for j in range(y.shape[1]):
        seen = ~np.isnan(y[:, j])
        if np.unique(y[seen, j]).size < 2:
            levels[j] = float(smoothed_prevalence(y[:, j]))
        else:
            models[j] = logistic().fit(x[seen], y[seen, j].astype(np.int64))

    def predict(rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, np.float64)
        return np.column_stack([models[j].predict_proba(rows)[:, 1] if j in models else np.full(len(rows), levels[j])
                                for j in range(y.shape[1])])
    return PooledReference("logistic regression per label on the pooled annotated training rows", predict)


def _ridge(x: np.ndarray, y: np.ndarray) -> PooledReference | NotFitted:
    from scipy.stats import skew
    from sklearn.linear_model import Ridge

    keep = np.isfinite(y)
    x, y = x[keep], y[keep]
    if y.size < 2:
        return NotFitted("fewer than two labelled pooled training rows")
    nonnegative = bool(y.min() >= 0)
    on_log = nonnegative and np.ptp(y) > 0 and float(skew(y)) > SKEW_LIMIT
    model = Ridge(alpha=1.0).fit(x, np.log1p(y) if on_log else y)

    def predict(rows: np.ndarray) -> np.ndarray:
        out = model.predict(np.asarray(rows, np.float64))
        out = np.expm1(out) if on_log else out
        return np.maximum(out, 0.0) if nonnegative else out  # as the sites read a non-negative target
    what = "ridge regression on log1p(y), predictions expm1" if on_log else "ridge regression on y"
    return PooledReference(f"{what}, on the pooled training rows", predict)
