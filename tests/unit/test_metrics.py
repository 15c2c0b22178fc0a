"""Whole-split binary metrics and the mean over defined values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedmqtt.metrics import METRIC_NAMES, binary_metrics, mean_defined


def test_auroc_auprc_match_hand_computed_values() -> None:
    """y=[0,0,1,1], s=[.1,.4,.35,.8]: AUROC 0.75 (3 of 4 pairs), AP 0.8333 (docs/algorithms.md 17.2)."""
    values, reasons = binary_metrics(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8]))
    assert reasons == {}
    assert values["auroc"] == pytest.approx(0.75)
    assert values["auprc"] == pytest.approx(0.8333333333)
    # Predictions at 0.5: [0, 0, 0, 1] -> 3 of 4 right; recalls 1.0 and 0.5.
    assert values["accuracy"] == pytest.approx(0.75)
    assert values["balanced_accuracy"] == pytest.approx(0.75)
    expected_loss = -np.mean(np.log([0.9, 0.6, 0.35, 0.8]))
    assert values["loss"] == pytest.approx(expected_loss)


def test_ties_count_one_half() -> None:
    """y=[0,1,0,1], s=[.5,.5,.2,.9]: a tied pair counts 1/2, AUROC 0.875, AP 0.8333."""
    values, _ = binary_metrics(np.array([0, 1, 0, 1]), np.array([0.5, 0.5, 0.2, 0.9]))
    assert values["auroc"] == pytest.approx(0.875)
    assert values["auprc"] == pytest.approx(0.8333333333)


def test_values_are_plain_python_floats() -> None:
    """Every defined metric is a python float (serialisable without numpy)."""
    values, _ = binary_metrics(np.array([0, 1, 1]), np.array([0.2, 0.7, 0.4]))
    assert set(values) == set(METRIC_NAMES)
    assert all(type(v) is float for v in values.values())


def test_one_class_split_gives_none_with_reason() -> None:
    """With positives only, AUROC/AUPRC/balanced accuracy are None with a reason; accuracy is defined."""
    values, reasons = binary_metrics(np.ones(12, dtype=np.int64), np.linspace(0.1, 0.9, 12))
    assert values["auroc"] is None and values["auprc"] is None and values["balanced_accuracy"] is None
    assert reasons["auroc"] == "only one class (positive) in this split (n=12)"
    assert values["accuracy"] == pytest.approx(6 / 12)
    assert values["loss"] is not None and "loss" not in reasons


def test_empty_split_is_all_none() -> None:
    """An empty split makes every metric None with the reason 'empty split'."""
    values, reasons = binary_metrics(np.zeros(0, dtype=np.int64), np.zeros(0))
    assert all(v is None for v in values.values())
    assert set(reasons) == set(METRIC_NAMES) and "empty" in reasons["auroc"]


def test_loss_is_clipped_for_confident_mistakes() -> None:
    """A probability of exactly 0 for a positive gives a large finite loss, not inf."""
    values, _ = binary_metrics(np.array([1, 0]), np.array([0.0, 0.0]))
    assert values["loss"] is not None and math.isfinite(values["loss"]) and values["loss"] > 10


def test_nonfinite_scores_are_undefined_not_a_crash() -> None:
    """NaN scores (a diverged model) make every metric None with a reason."""
    values, reasons = binary_metrics(np.array([0, 1]), np.array([np.nan, 0.5]))
    assert all(v is None for v in values.values()) and "NaN" in reasons["loss"]


def test_bad_inputs_raise() -> None:
    """Mismatched lengths and non-binary labels raise ValueError."""
    with pytest.raises(ValueError, match="labels but"):
        binary_metrics(np.array([0, 1]), np.array([0.5]))
    with pytest.raises(ValueError, match="0/1"):
        binary_metrics(np.array([0, 2]), np.array([0.5, 0.5]))


def test_mean_defined_skips_none() -> None:
    """mean_defined averages defined values only, unweighted, and is None when none are defined."""
    assert mean_defined([0.5, None, 1.0]) == pytest.approx(0.75)
    assert mean_defined([None, None]) is None
    assert mean_defined([]) is None
