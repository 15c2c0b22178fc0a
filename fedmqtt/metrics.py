"""Whole-split metrics per task (docs/algorithms.md 17.2-17.4), pooled metrics and best-round selection (17.1)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

# numpy alone (the values scikit-learn's functions gave): a site validates every round, and importing
# scikit-learn would cost each site process about a CPU second (fedmqtt.scoring).
from fedmqtt import scoring

# Re-exported: the PS imports these from fedmqtt.means, without scikit-learn.
from fedmqtt.means import (  # noqa: F401
    LOWER_IS_BETTER,
    Direction,
    best_round,
    direction_of,
    mean_defined,
    round_score,
)

if TYPE_CHECKING:
    from fedmqtt.data.base import TaskInfo

Metrics = dict[str, float | None]
Reasons = dict[str, str]

METRIC_NAMES: tuple[str, ...] = ("auroc", "auprc", "accuracy", "balanced_accuracy", "loss")  # binary
MULTICLASS_NAMES: tuple[str, ...] = METRIC_NAMES
MULTILABEL_NAMES: tuple[str, ...] = ("auroc", "auprc", "accuracy", "loss")  # plus "auroc.<label>", ...
REGRESSION_NAMES: tuple[str, ...] = ("mae", "mape", "mse", "msle")
# Probabilities are clipped before the log so a confident wrong prediction costs ~34.5, not inf.
_EPS = 1e-15


def _screen(names: Sequence[str], n: int, scores: np.ndarray) -> tuple[Metrics, Reasons] | None:
    """All-None results for an empty split or non-finite scores (a diverged model), else None."""
    if n == 0:
        return dict.fromkeys(names), dict.fromkeys(names, "empty split (n=0)")
    bad = int((~np.isfinite(scores)).sum())
    if bad:
        why = f"scores contain NaN or inf ({bad} of {scores.size} values, n={n})"
        return dict.fromkeys(names), dict.fromkeys(names, why)
    return None


def binary_metrics(
    y_true: np.ndarray, score: np.ndarray, *, threshold: float = 0.5
) -> tuple[Metrics, Reasons]:
    """Metrics of positive-class probabilities `score` against 0/1 labels `y_true`.

    AUROC, AUPRC (average precision) and balanced accuracy need both classes in the split; with
    one class they are None (AP would be trivially 1 or undefined, balanced accuracy would just be
    accuracy). Accuracy (threshold 0.5) and loss (binary cross-entropy) are defined for any non-empty split.

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
    early = _screen(METRIC_NAMES, n, p)
    if early:
        return early
    values: Metrics = dict.fromkeys(METRIC_NAMES)
    reasons: Reasons = {}
    pred = (p >= threshold).astype(np.int64)
    values["accuracy"] = scoring.accuracy(y, pred)
    values["loss"] = scoring.binary_log_loss(y, np.clip(p, _EPS, 1.0 - _EPS))
    classes = np.unique(y)
    if classes.size < 2:
        which = "positive" if classes[0] == 1 else "negative"
        for name in ("auroc", "auprc", "balanced_accuracy"):
            reasons[name] = f"only one class ({which}) in this split (n={n})"
        return values, reasons
    values["auroc"] = scoring.roc_auc(y, p)
    values["auprc"] = scoring.average_precision(y, p)
    values["balanced_accuracy"] = scoring.macro_recall(y, pred)
    return values, reasons


def multiclass_metrics(y_true: np.ndarray, proba: np.ndarray) -> tuple[Metrics, Reasons]:
    """Class indices `y_true` `(n,)` against softmax probabilities over all classes `proba` `(n, C)`.

    AUROC/AUPRC: macro mean of "class c vs rest" over the classes with at least one positive and one
    negative in the split (docs/algorithms.md 17.2); balanced accuracy: mean recall over the classes
    present. All three are None when fewer than two classes are present. Accuracy uses the argmax;
    loss is the cross-entropy of the true class.

    Raises:
        ValueError: shapes differ, or a label is not a class index in [0, C).
    """
    y = np.asarray(y_true).reshape(-1)
    p = np.asarray(proba, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] != y.shape[0]:
        raise ValueError(f"{y.shape[0]} labels but probabilities of shape {p.shape}")
    if y.size and not (np.isin(y, np.arange(p.shape[1]))).all():
        raise ValueError(f"labels must be class indices in [0, {p.shape[1]}), got {sorted(set(y.tolist()))}")
    y, n = y.astype(np.int64), int(y.size)
    early = _screen(MULTICLASS_NAMES, n, p)
    if early:
        return early
    pred = p.argmax(axis=1)
    values: Metrics = dict.fromkeys(MULTICLASS_NAMES)
    values["accuracy"] = scoring.accuracy(y, pred)
    values["loss"] = float(-np.mean(np.log(np.clip(p[np.arange(n), y], _EPS, 1.0))))
    present = np.unique(y)
    if present.size < 2:
        why = f"only one class ({present[0]}) in this split (n={n})"
        return values, dict.fromkeys(("auroc", "auprc", "balanced_accuracy"), why)
    # Classes absent from y have no positive and are skipped, never scored (17.2).
    values["auroc"] = float(np.mean([scoring.roc_auc(y == c, p[:, c]) for c in present]))
    values["auprc"] = float(np.mean([scoring.average_precision(y == c, p[:, c]) for c in present]))
    values["balanced_accuracy"] = scoring.macro_recall(y, pred)  # mean recall over the classes present
    return values, {}


def multilabel_metrics(
    y_true: np.ndarray, proba: np.ndarray, *, label_names: Sequence[str] | None = None, threshold: float = 0.5
) -> tuple[Metrics, Reasons]:
    """0/1 label matrix `y_true` `(n, L)`, NaN where not annotated, against sigmoid probabilities `(n, L)`.

    Per label j, over its annotated rows: "auroc.<name_j>" and "auprc.<name_j>" (None unless both
    values occur). "auroc"/"auprc": macro mean over the defined labels. "accuracy": exact match of
    the thresholded vector on the annotated entries, over rows with at least one. "loss": binary
    cross-entropy averaged over annotated entries (the training loss). `per_label` regroups the result.

    Raises:
        ValueError: shapes differ, or an annotated label is not 0/1.
    """
    y = np.asarray(y_true, dtype=np.float64)
    p = np.asarray(proba, dtype=np.float64)
    y = y.reshape(y.shape[0], -1) if y.ndim else y
    if p.shape != y.shape:
        raise ValueError(f"labels of shape {y.shape} but probabilities of shape {p.shape}")
    annotated = ~np.isnan(y)
    if not np.isin(y[annotated], (0.0, 1.0)).all():
        raise ValueError("annotated labels must be 0/1 (NaN = not annotated)")
    names = [str(j) for j in range(y.shape[1])] if label_names is None else [str(s) for s in label_names]
    keys = [*MULTILABEL_NAMES, *(f"{m}.{name}" for name in names for m in ("auroc", "auprc"))]
    early = _screen(keys, int(y.shape[0]), p)
    if early:
        return early
    values: Metrics = dict.fromkeys(keys)
    reasons: Reasons = {}
    for j, name in enumerate(names):
        yj, pj = y[annotated[:, j], j], p[annotated[:, j], j]
        classes = np.unique(yj)
        if classes.size < 2:
            which = "positive" if yj.size and classes[0] == 1 else "negative"
            why = f"only one class ({which}) among n={yj.size} annotated"
            why = why if yj.size else "no annotated samples"
            reasons[f"auroc.{name}"] = reasons[f"auprc.{name}"] = why
            continue
        values[f"auroc.{name}"] = scoring.roc_auc(yj, pj)
        values[f"auprc.{name}"] = scoring.average_precision(yj, pj)
    for metric in ("auroc", "auprc"):
        values[metric] = mean_defined(values[f"{metric}.{name}"] for name in names)
        if values[metric] is None:
            reasons[metric] = f"no label has both classes annotated in this split (n={y.shape[0]})"
    _multilabel_accuracy_loss(y, p, annotated, threshold, values, reasons)
    return values, reasons


def _multilabel_accuracy_loss(
    y: np.ndarray, p: np.ndarray, annotated: np.ndarray, threshold: float, values: Metrics, reasons: Reasons
) -> None:
    rows = annotated.any(axis=1)
    if not rows.any():
        reasons["accuracy"] = reasons["loss"] = "no annotated labels in this split"
        return
    exact = ((p >= threshold) == (y == 1.0)) | ~annotated
    values["accuracy"] = float(exact.all(axis=1)[rows].mean())
    q = np.clip(p[annotated], _EPS, 1.0 - _EPS)
    t = y[annotated]
    values["loss"] = float(-np.mean(t * np.log(q) + (1.0 - t) * np.log(1.0 - q)))


def per_label(values: Mapping[str, float | None]) -> dict[str, dict[str, float | None]]:
    """Regroup `multilabel_metrics` keys: `{"auroc.af": .9, "auprc.af": .8}` -> `{"af": {...}}`."""
    table: dict[str, dict[str, float | None]] = {}
    for key, value in values.items():
        metric, dot, label = key.partition(".")
        if dot:
            table.setdefault(label, {})[metric] = value
    return table


def regression_metrics(y_true: np.ndarray, pred: np.ndarray) -> tuple[Metrics, Reasons]:
    """MAE, MAPE (a fraction; denominator max(|y|, float64 eps)), MSE and MSLE (docs/algorithms.md 17.3).

    Rows whose target is NaN (unlabelled) are left out. MSLE is None when a target or a prediction
    is negative (ln(1 + v) is not meant for them; predict with `nonnegative=True` for lengths of stay).

    Raises:
        ValueError: shapes differ.
    """
    y = np.asarray(y_true, dtype=np.float64).reshape(-1)
    yh = np.asarray(pred, dtype=np.float64).reshape(-1)
    if y.shape != yh.shape:
        raise ValueError(f"{y.shape[0]} targets but {yh.shape[0]} predictions")
    labelled = ~np.isnan(y)
    y, yh = y[labelled], yh[labelled]
    early = _screen(REGRESSION_NAMES, int(y.size), yh)
    if early:
        return early
    values: Metrics = {
        "mae": scoring.mean_absolute_error(y, yh),
        "mape": scoring.mean_absolute_percentage_error(y, yh),
        "mse": scoring.mean_squared_error(y, yh),
        "msle": None,
    }
    negative = (int((y < 0).sum()), int((yh < 0).sum()))
    if any(negative):
        return values, {"msle": f"negative values ({negative[0]} targets, {negative[1]} predictions)"}
    values["msle"] = scoring.mean_squared_log_error(y, yh)
    return values, {}


def cinc_challenge_score(
    labels: np.ndarray, outputs: np.ndarray, weights: np.ndarray, *, normal_index: int, threshold: float = 0.5
) -> float:
    """PhysioNet/CinC 2021 challenge score (docs/algorithms.md 17.4; physionetchallenges/evaluation-2021).

    Args:
        labels: 0/1 matrix `(recordings, classes)`, complete (no NaN).
        outputs: 0/1 decisions or probabilities, same shape; a class is output when > `threshold`.
        weights: the challenge's `(classes, classes)` weight matrix, in the same class order.
        normal_index: column of the normal class (sinus rhythm, 426783006).

    Returns:
        `(observed - inactive) / (correct - inactive)`, 0.0 when the denominator is 0.
    """
    lab = np.asarray(labels, dtype=np.float64)
    if np.isnan(lab).any():
        raise ValueError("the CinC score needs complete labels (no NaN)")
    out = np.asarray(outputs, dtype=np.float64) > threshold
    w = np.asarray(weights, dtype=np.float64)
    if out.shape != lab.shape or w.shape != (lab.shape[1], lab.shape[1]):
        raise ValueError(f"labels {lab.shape}, outputs {out.shape} and weights {w.shape} do not fit")
    truth = lab == 1.0
    normal = np.zeros_like(truth)
    normal[:, normal_index] = True
    observed, correct, inactive = (float(np.sum(w * _cinc_confusion(truth, o))) for o in (out, truth, normal))
    return 0.0 if correct == inactive else (observed - inactive) / (correct - inactive)


def _cinc_confusion(truth: np.ndarray, out: np.ndarray) -> np.ndarray:
    """A[j, k] += 1/u for every true class j and output class k of a recording; u = |labels or outputs|."""
    u = np.maximum((truth | out).sum(axis=1), 1).astype(np.float64)
    return (truth / u[:, None]).T @ out.astype(np.float64)


def load_cinc_weights(path: str | Path) -> tuple[list[tuple[str, ...]], np.ndarray]:
    """Classes and weight matrix of the challenge's `weights.csv` (codes counted as one class joined by "|").

    Raises:
        ValueError: the row classes differ from the column classes.
    """
    rows = [line.split(",") for line in Path(path).read_text().splitlines() if line.strip()]
    classes = [tuple(code.strip().split("|")) for code in rows[0][1:]]
    if [tuple(r[0].strip().split("|")) for r in rows[1:]] != classes:
        raise ValueError(f"{path}: row classes differ from column classes")
    return classes, np.array([[float(v) for v in r[1:]] for r in rows[1:]], dtype=np.float64)


def task_metrics(task: TaskInfo, y: np.ndarray, scores: np.ndarray) -> tuple[Metrics, Reasons]:
    """The metrics of `task.kind` for labels `y` and `evaluate.predict`-shaped `scores`.

    Multilabel per-label keys use `task.label_names` when it names every output, else indices.
    """
    if task.kind == "binary":
        return binary_metrics(y, scores)
    if task.kind == "multiclass":
        return multiclass_metrics(y, scores)
    if task.kind == "multilabel":
        width = np.asarray(scores).shape[-1] if np.asarray(scores).ndim == 2 else -1
        names = task.label_names if len(task.label_names) == width else None
        return multilabel_metrics(y, scores, label_names=names)
    if task.kind == "regression":
        return regression_metrics(y, scores)
    raise ValueError(f"unknown task kind {task.kind!r}")


def pooled_metrics(
    task: TaskInfo, parts: Sequence[tuple[np.ndarray, np.ndarray]]
) -> tuple[Metrics, Reasons]:
    """Metrics of the pooled predictions of several sites: `[(y_i, scores_i), ...]` concatenated first.

    Never an average of per-site AUROCs (docs/algorithms.md 17.2); the per-site values are `task_metrics`
    of each part, and their unweighted mean is `mean_defined`.
    """
    if not parts:
        raise ValueError("pooled_metrics needs at least one site")
    y = np.concatenate([np.asarray(yi) for yi, _ in parts])
    scores = np.concatenate([np.asarray(si) for _, si in parts])
    return task_metrics(task, y, scores)
