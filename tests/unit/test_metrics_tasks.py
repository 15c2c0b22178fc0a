"""Multi-class, multi-label, regression and CinC metrics, pooling, best-round selection (docs/algorithms.md 17)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from fedmqtt.data.base import BINARY, TaskInfo
from fedmqtt.metrics import (
    MULTILABEL_NAMES,
    best_round,
    binary_metrics,
    cinc_challenge_score,
    direction_of,
    load_cinc_weights,
    mean_defined,
    multiclass_metrics,
    multilabel_metrics,
    per_label,
    pooled_metrics,
    regression_metrics,
    round_score,
    task_metrics,
)

# docs/algorithms.md 17.2 worked examples
MC_Y = np.array([0, 1, 1, 0, 1])
MC_P = np.array([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3], [0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.1, 0.8, 0.1]])
ML_Y = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 0], [0, 0, 1]], dtype=np.float64)
ML_P = np.array([[0.9, 0.2, 0.6], [0.3, 0.7, 0.4], [0.6, 0.4, 0.5], [0.2, 0.1, 0.8]])
# docs/algorithms.md 17.4 worked example: classes A, B, SR
CINC_W = np.array([[1, 0.5, 0], [0.5, 1, 0.25], [0, 0.25, 1]])
CINC_L = np.array([[1, 0, 0], [1, 1, 0], [0, 0, 1]])
CINC_O = np.array([[1, 0, 0], [0, 1, 0], [1, 0, 0]])


def test_multiclass_worked_example() -> None:
    """17.2: class 2 skipped; per class AUROC .8333/.8333, AP .8333/.9167; macro .8333, .875; accuracy .8."""
    for c, auroc, ap in [(0, 0.8333333333, 0.8333333333), (1, 0.8333333333, 0.9166666667)]:
        one_vs_rest, _ = binary_metrics((MC_Y == c).astype(int), MC_P[:, c])
        assert one_vs_rest["auroc"] == pytest.approx(auroc) and one_vs_rest["auprc"] == pytest.approx(ap)
    values, reasons = multiclass_metrics(MC_Y, MC_P)
    assert reasons == {}
    assert values["auroc"] == pytest.approx(0.8333333333)
    assert values["auprc"] == pytest.approx(0.875)
    assert values["accuracy"] == pytest.approx(0.8)
    assert values["balanced_accuracy"] == pytest.approx((2 / 2 + 2 / 3) / 2)  # recalls of classes 0 and 1
    assert values["loss"] == pytest.approx(-np.mean(np.log([0.7, 0.5, 0.3, 0.5, 0.8])))


def test_multiclass_one_class_is_undefined_and_labels_checked() -> None:
    """With one class present, AUROC/AUPRC/balanced accuracy are None with a reason; bad labels raise."""
    values, reasons = multiclass_metrics(np.array([1, 1]), MC_P[:2])
    assert values["auroc"] is None and values["balanced_accuracy"] is None
    assert reasons["auprc"] == "only one class (1) in this split (n=2)"
    assert values["accuracy"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="class indices"):
        multiclass_metrics(np.array([0, 3]), MC_P[:2])
    with pytest.raises(ValueError, match="labels but"):
        multiclass_metrics(np.array([0]), MC_P[:2])
    empty, why = multiclass_metrics(np.zeros(0, np.int64), np.zeros((0, 3)))
    assert all(v is None for v in empty.values()) and "empty" in why["loss"]


def test_multilabel_worked_example() -> None:
    """17.2: per-label AUROC 1, 1, .6667 (macro .8889); AP 1, 1, .9167 (macro .9722)."""
    values, reasons = multilabel_metrics(ML_Y, ML_P, label_names=["a", "b", "c"])
    assert reasons == {}
    assert values["auroc"] == pytest.approx(0.8888888889)
    assert values["auprc"] == pytest.approx(0.9722222222)
    table = per_label(values)
    assert list(table) == ["a", "b", "c"]
    assert table["c"]["auroc"] == pytest.approx(0.6666666667)
    assert table["c"]["auprc"] == pytest.approx(0.9166666667)
    assert table["a"] == {"auroc": 1.0, "auprc": 1.0}
    # Exact match at 0.5: rows 1 and 4 right, rows 2 and 3 wrong.
    assert values["accuracy"] == pytest.approx(0.5)
    assert set(MULTILABEL_NAMES) <= set(values)


def test_multilabel_masks_partial_labels() -> None:
    """NaN entries are left out per label; an unannotated label is None and left out of the macro mean."""
    y = np.array([[1, np.nan, np.nan], [0, 1, np.nan], [np.nan, 1, np.nan], [1, np.nan, np.nan]])
    p = np.array([[0.8, 0.9, 0.5], [0.3, 0.2, 0.5], [0.99, 0.7, 0.5], [0.1, 0.4, 0.5]])
    values, reasons = multilabel_metrics(y, p)
    # label 0 on rows 0, 1, 3: y=[1,0,1], s=[.8,.3,.1] -> pairs (.8>.3) yes, (.1>.3) no: AUROC .5
    assert values["auroc.0"] == pytest.approx(0.5)
    assert values["auroc.1"] is None and reasons["auroc.1"] == "only one class (positive) among n=2 annotated"
    assert values["auroc.2"] is None and reasons["auprc.2"] == "no annotated samples"
    assert values["auroc"] == pytest.approx(0.5)  # macro over the one defined label
    terms = [np.log(0.8), np.log(0.7), np.log(0.1), np.log(0.2), np.log(0.7)]
    assert values["loss"] == pytest.approx(-np.mean(terms))
    # Exact match on annotated entries: row 0 yes, row 1 (.3 -> 0 ok, .2 -> 0 vs 1) no, row 2 yes, row 3 no.
    assert values["accuracy"] == pytest.approx(0.5)
    none, why = multilabel_metrics(np.full((2, 2), np.nan), np.full((2, 2), 0.5))
    assert none["auroc"] is None and none["accuracy"] is None and "no label" in why["auroc"]
    with pytest.raises(ValueError, match="0/1"):
        multilabel_metrics(np.array([[2.0]]), np.array([[0.5]]))


def test_regression_worked_example() -> None:
    """17.3: y=[1,2,4,.5], yh=[1.5,1,5,.5]: MAE .625, MAPE .3125, MSE .5625, MSLE .0618590371."""
    values, reasons = regression_metrics(np.array([1, 2, 4, 0.5]), np.array([1.5, 1, 5, 0.5]))
    assert reasons == {}
    assert values == pytest.approx({"mae": 0.625, "mape": 0.3125, "mse": 0.5625, "msle": 0.0618590371})


def test_regression_edge_cases() -> None:
    """MAPE divides by max(|y|, eps); negative values make MSLE undefined; NaN targets are left out."""
    values, _ = regression_metrics(np.array([0.0]), np.array([1.0]))
    assert values["mape"] == pytest.approx(1.0 / np.finfo(np.float64).eps)
    values, reasons = regression_metrics(np.array([1.0, 2.0]), np.array([-0.5, 2.0]))
    assert values["msle"] is None and reasons["msle"] == "negative values (0 targets, 1 predictions)"
    assert values["mae"] == pytest.approx(0.75)
    values, _ = regression_metrics(np.array([1.0, np.nan, 4.0]), np.array([1.5, 100.0, 5.0]))
    assert values["mae"] == pytest.approx(0.75)
    values, reasons = regression_metrics(np.array([1.0]), np.array([np.nan]))
    assert values["mse"] is None and "NaN" in reasons["mse"]


def test_cinc_worked_example() -> None:
    """17.4: observed 1.75, correct 3.5, inactive 1.0833; score 0.2758620690."""
    assert cinc_challenge_score(CINC_L, CINC_O, CINC_W, normal_index=2) == pytest.approx(0.2758620690)


def test_cinc_reference_points_and_threshold() -> None:
    """Perfect = 1, always-sinus-rhythm = 0, probabilities count only when > 0.5, zero denominator = 0."""
    assert cinc_challenge_score(CINC_L, CINC_L, CINC_W, normal_index=2) == pytest.approx(1.0)
    always_sr = np.tile([0, 0, 1], (3, 1))
    assert cinc_challenge_score(CINC_L, always_sr, CINC_W, normal_index=2) == pytest.approx(0.0)
    proba = np.where(CINC_O == 1, 0.51, 0.5)  # 0.5 exactly is not an output
    assert cinc_challenge_score(CINC_L, proba, CINC_W, normal_index=2) == pytest.approx(0.2758620690)
    only_sr = np.tile([0, 0, 1], (2, 1))
    assert cinc_challenge_score(only_sr, np.zeros((2, 3)), CINC_W, normal_index=2) == 0.0
    with pytest.raises(ValueError, match="NaN"):
        cinc_challenge_score(np.array([[np.nan, 0, 1]]), np.zeros((1, 3)), CINC_W, normal_index=2)


def test_load_cinc_weights_reads_the_challenge_layout(tmp_path: Path) -> None:
    """weights.csv: a header of classes ("a|b" = one class), then one row per class."""
    path = tmp_path / "weights.csv"
    path.write_text(",1,2|3,426783006\n1,1,0.5,0\n2|3,0.5,1,0.25\n426783006,0,0.25,1\n")
    classes, weights = load_cinc_weights(path)
    assert classes == [("1",), ("2", "3"), ("426783006",)]
    np.testing.assert_array_equal(weights, CINC_W)
    path.write_text(",1,2\n2,1,0\n1,0,1\n")
    with pytest.raises(ValueError, match="differ"):
        load_cinc_weights(path)


def test_pooled_metrics_use_pooled_scores_not_mean_of_sites() -> None:
    """Two sites with AUROC 1 each pool to 0.75 (3 of 4 pairs), not 1; a one-class site still pools."""
    sites = [(np.array([0, 1]), np.array([0.1, 0.2])), (np.array([0, 1]), np.array([0.8, 0.9]))]
    per_site = [binary_metrics(y, s)[0]["auroc"] for y, s in sites]
    assert per_site == [1.0, 1.0] and mean_defined(per_site) == 1.0
    pooled, _ = pooled_metrics(BINARY, sites)
    assert pooled["auroc"] == pytest.approx(0.75)
    one_class = (np.array([1, 1]), np.array([0.3, 0.35]))
    assert binary_metrics(*one_class)[0]["auroc"] is None
    pooled, _ = pooled_metrics(BINARY, [sites[0], one_class])  # y=[0,1,1,1] s=[.1,.2,.3,.35]
    assert pooled["auroc"] == pytest.approx(1.0)
    multi, _ = pooled_metrics(TaskInfo("multiclass", 3), [(MC_Y[:2], MC_P[:2]), (MC_Y[2:], MC_P[2:])])
    assert multi["auprc"] == pytest.approx(0.875)
    with pytest.raises(ValueError):
        pooled_metrics(BINARY, [])


def test_task_metrics_dispatch_and_label_names() -> None:
    """task_metrics picks the task's metrics; multilabel keys use TaskInfo.label_names when they fit."""
    named = TaskInfo("multilabel", 3, ("af", "rbbb", "sr"))
    values, _ = task_metrics(named, ML_Y, ML_P)
    assert values["auroc.sr"] == pytest.approx(0.6666666667)
    values, _ = task_metrics(TaskInfo("multilabel", 3), ML_Y, ML_P)
    assert "auroc.2" in values
    regression, _ = task_metrics(TaskInfo("regression"), np.ones(2), np.ones(2))
    assert set(regression) == {"mae", "mape", "mse", "msle"}
    assert task_metrics(TaskInfo("multiclass", 3), MC_Y, MC_P)[0]["accuracy"] == pytest.approx(0.8)


def test_best_round_leaves_out_undefined_sites() -> None:
    """17.1 DECISION: a site whose metric is undefined is left out of that round's unweighted mean."""
    history = {1: {"a": {"auroc": 0.6}, "b": {"auroc": None}}, 2: {"a": {"auroc": 0.7}, "b": {"auroc": 0.3}}}
    assert round_score(history[1], "auroc") == pytest.approx(0.6)
    assert best_round(history, "auroc") == (1, pytest.approx(0.6))  # counting None as 0 would give 0.3


def test_best_round_all_undefined_round_is_not_eligible() -> None:
    """A round where every site is undefined (or the metric is missing or NaN) cannot be chosen."""
    history = {1: {"a": {"auroc": None}}, 2: {"a": {}}, 3: {"a": {"auroc": math.nan}}}
    assert best_round(history, "auroc") is None
    history[4] = {"a": {"auroc": 0.1}}
    assert best_round(history, "auroc") == (4, pytest.approx(0.1))


def test_best_round_starts_at_minus_infinity_and_ties_keep_earlier() -> None:
    """Negative scores (CinC) are eligible; an equal later score does not replace the earlier round."""
    negative = {1: {"a": {"cinc_score": -0.3}}, 2: {"a": {"cinc_score": -0.4}}}
    assert best_round(negative, "cinc_score") == (1, pytest.approx(-0.3))  # Hwang et al.'s start at 0: none
    tied = {2: {"a": {"auroc": 0.8}}, 1: {"a": {"auroc": 0.8}}, 3: {"a": {"auroc": 0.79}}}
    assert best_round(tied, "auroc") == (1, pytest.approx(0.8))  # rounds are visited in order


def test_best_round_minimises_loss_metrics() -> None:
    """Loss-type metrics (BCE as Kulkarni et al., MSLE as Scheltjens et al.) select the minimum; ties keep the
    earlier round."""
    assert direction_of("loss") == direction_of("msle") == "min" and direction_of("auroc") == "max"
    history = {1: {"a": {"loss": 0.5}}, 2: {"a": {"loss": 0.4}}, 3: {"a": {"loss": 0.4}}}
    assert best_round(history, "loss") == (2, pytest.approx(0.4))
    assert best_round(history, "loss", "max") == (1, pytest.approx(0.5))
