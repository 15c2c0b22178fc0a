"""fedmqtt.scoring gives the very floats scikit-learn's metric functions gave (ties and rounded scores included)."""

from __future__ import annotations

import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn import metrics as reference

from fedmqtt import scoring

SEEDS = st.integers(0, 2**32 - 1)


def _binary(seed: int, n: int, decimals: int | None) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    y[0], y[1] = 0, 1  # both classes: the callers in fedmqtt.metrics only score such splits
    p = rng.random(n)
    if decimals is not None:  # many tied scores, as a model that saturates makes
        p = np.round(p, decimals)
    return y, np.clip(p, 1e-15, 1 - 1e-15)


@settings(max_examples=300, deadline=None)
@given(seed=SEEDS, n=st.integers(2, 500), decimals=st.one_of(st.none(), st.integers(0, 3)))
def test_binary_scores_equal_scikit_learn(seed: int, n: int, decimals: int | None) -> None:
    y, p = _binary(seed, n, decimals)
    pred = (p >= 0.5).astype(np.int64)
    assert scoring.roc_auc(y, p) == reference.roc_auc_score(y, p)
    assert scoring.average_precision(y, p) == reference.average_precision_score(y, p)
    assert scoring.roc_auc(y == 1, p) == reference.roc_auc_score(y == 1, p)  # boolean labels (class vs rest)
    assert scoring.roc_auc(y.astype(np.float64), p) == reference.roc_auc_score(y.astype(np.float64), p)
    assert scoring.average_precision(y.astype(np.float64), p) == reference.average_precision_score(
        y.astype(np.float64), p)  # multilabel columns are float 0/1
    assert scoring.accuracy(y, pred) == reference.accuracy_score(y, pred)
    assert scoring.binary_log_loss(y, p) == reference.log_loss(y, p, labels=[0, 1])
    assert scoring.macro_recall(y, pred) == reference.balanced_accuracy_score(y, pred)


@settings(max_examples=200, deadline=None)
@given(seed=SEEDS, n=st.integers(2, 500), classes=st.integers(2, 8))
def test_macro_recall_equals_scikit_learn(seed: int, n: int, classes: int) -> None:
    rng = np.random.default_rng(seed)
    y, pred = rng.integers(0, classes, n), rng.integers(0, classes, n)
    present = np.unique(y)
    with warnings.catch_warnings():  # a class predicted but never true: scikit-learn warns, then drops it
        warnings.simplefilter("ignore")
        assert scoring.macro_recall(y, pred) == reference.balanced_accuracy_score(y, pred)
    assert scoring.macro_recall(y, pred) == reference.recall_score(y, pred, labels=present, average="macro",
                                                                   zero_division=0)


@settings(max_examples=200, deadline=None)
@given(seed=SEEDS, n=st.integers(1, 500), zero_target=st.booleans())
def test_regression_errors_equal_scikit_learn(seed: int, n: int, zero_target: bool) -> None:
    rng = np.random.default_rng(seed)
    y, yh = rng.gamma(2.0, 3.0, n), rng.gamma(2.0, 3.0, n)
    if zero_target:
        y[0] = 0.0
    assert scoring.mean_absolute_error(y, yh) == reference.mean_absolute_error(y, yh)
    assert scoring.mean_absolute_percentage_error(y, yh) == reference.mean_absolute_percentage_error(y, yh)
    assert scoring.mean_squared_error(y, yh) == reference.mean_squared_error(y, yh)
    assert scoring.mean_squared_log_error(y, yh) == reference.mean_squared_log_error(y, yh)


def test_published_small_cases() -> None:
    """Hand-checkable values: a perfect ranking, one swapped pair, all scores tied."""
    y = np.array([0, 0, 1, 1])
    assert scoring.roc_auc(y, np.array([0.1, 0.2, 0.8, 0.9])) == 1.0
    assert scoring.roc_auc(y, np.array([0.1, 0.8, 0.2, 0.9])) == 0.75
    assert scoring.roc_auc(y, np.full(4, 0.5)) == 0.5
    assert scoring.average_precision(y, np.full(4, 0.5)) == 0.5
    assert scoring.average_precision(y, np.array([0.1, 0.8, 0.2, 0.9])) == (1 + 2 / 3) / 2
