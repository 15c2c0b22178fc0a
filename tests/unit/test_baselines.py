"""What a run's model is measured against: metric-optimal constants (checked against brute-force search),
the pooled reference model and the site-alone predictor with its label-leak warning."""

from __future__ import annotations

import numpy as np
import pytest

from fedmqtt.baseline_report import LEAK, baselines_section
from fedmqtt.baselines import metric_optimal_constants, smoothed_prevalence
from fedmqtt.data.base import BINARY, TaskInfo
from fedmqtt.data.splits import SiteData
from fedmqtt.metrics import task_metrics
from fedmqtt.pooled_reference import NotFitted, PooledReference, fit_pooled_reference

REGRESSION = TaskInfo("regression")
EPS = np.finfo(np.float64).eps


def _grid_losses(y: np.ndarray, grid: np.ndarray) -> dict[str, np.ndarray]:
    """Each regression metric of every constant in `grid`, computed directly (rows: constants)."""
    c = grid[:, None]
    return {"mse": np.mean((y - c) ** 2, axis=1), "mae": np.mean(np.abs(y - c), axis=1),
            "msle": np.mean((np.log1p(y) - np.log1p(c)) ** 2, axis=1),
            "mape": np.mean(np.abs(y - c) / np.maximum(np.abs(y), EPS), axis=1)}


def test_regression_constants_are_optimal_against_brute_force() -> None:
    """On skewed lengths of stay the four constants differ, and none is beaten by any of 20001 candidates."""
    y = np.random.default_rng(0).lognormal(mean=1.0, sigma=0.9, size=301)
    grid = np.linspace(0.0, y.max(), 20001)
    losses = _grid_losses(y, grid)
    constants = {c.metrics[0]: c for c in metric_optimal_constants(REGRESSION, y)}
    assert set(constants) == {"mse", "mae", "msle", "mape"}
    for metric, constant in constants.items():
        value = float(constant.value)
        achieved = task_metrics(REGRESSION, y, constant.predict(len(y)))[0][metric]
        assert achieved is not None and achieved <= losses[metric].min() + 1e-12, metric
        assert value == pytest.approx(grid[losses[metric].argmin()], abs=2 * (grid[1] - grid[0])), metric
    # The training mean (the old single baseline) is beaten on MAE and MSLE by their own constants.
    mean = np.full(len(y), float(constants["mse"].value))
    for metric in ("mae", "msle"):
        assert task_metrics(REGRESSION, y, mean)[0][metric] > losses[metric].min() * 1.05


def test_msle_constant_only_for_non_negative_targets() -> None:
    y = np.array([-1.0, 0.5, 2.0, 3.0])
    assert [c.name for c in metric_optimal_constants(REGRESSION, y)] == ["MSE", "MAE", "MAPE"]


def test_binary_constant_is_near_the_log_loss_optimum_and_the_majority_class() -> None:
    """(k+1)/(n+2) is within 1/(n+2) of the log-loss minimiser k/n, and thresholded it is the majority class."""
    y = np.array([1] * 7 + [0] * 13)
    grid = np.linspace(1e-4, 1 - 1e-4, 9999)
    loss = -(7 * np.log(grid) + 13 * np.log1p(-grid)) / 20
    accuracy = np.where(grid >= 0.5, 7, 13) / 20
    (constant,) = metric_optimal_constants(BINARY, y)
    p = float(constant.value)
    assert p == pytest.approx(8 / 22) and abs(p - grid[loss.argmin()]) <= 1 / 22
    metrics = task_metrics(BINARY, y, constant.predict(len(y)))[0]
    assert metrics["loss"] == pytest.approx(loss.min(), abs=0.01)
    assert metrics["accuracy"] == accuracy.max()
    assert metrics["auroc"] == 0.5  # any constant: a model's AUROC is compared with 0.5, not with this row


@pytest.mark.parametrize("labels", [[0] * 30, [1] * 30])
def test_smoothed_prevalence_is_never_zero_or_one(labels: list[int]) -> None:
    (constant,) = metric_optimal_constants(BINARY, np.array(labels))
    assert 0.0 < float(constant.value) < 1.0 and float(constant.value) in (1 / 32, 31 / 32)


def test_multiclass_constant_against_brute_force_over_the_simplex() -> None:
    y = np.array([0] * 5 + [1] * 12 + [2] * 3)
    task = TaskInfo("multiclass", 3)
    (constant,) = metric_optimal_constants(task, y)
    step = np.arange(1, 100) / 100
    a, b = np.meshgrid(step, step, indexing="ij")
    ok = a + b < 1
    simplex = np.stack([a[ok], b[ok], 1 - a[ok] - b[ok]], axis=1)
    losses = -np.log(simplex[:, y]).mean(axis=1)
    achieved = task_metrics(task, y, constant.predict(len(y)))[0]
    assert achieved["loss"] <= losses.min() + 0.02
    assert int(np.argmax(constant.value)) == 1 and achieved["accuracy"] == 12 / 20  # the majority class
    assert np.all(constant.value > 0) and constant.value.sum() == pytest.approx(1.0)


def test_partial_labels_constant_is_per_label_smoothed_over_annotated_entries() -> None:
    """The defect this replaces: np.nanmean gave a label without an annotated positive in training a
    prevalence of exactly 0, and one positive test record then cost ~35 nats (clipped log 0)."""
    nan = np.nan
    y_train = np.array([[1, 0, nan], [0, 0, nan], [1, 0, 1], [nan, 0, 0], [0, nan, 1]], dtype=np.float64)
    task = TaskInfo("multilabel", 3)
    (constant,) = metric_optimal_constants(task, y_train)
    assert constant.value == pytest.approx([3 / 6, 1 / 6, 3 / 5])  # (k+1)/(annotated+2) per label
    y_test = np.array([[0, 1, nan], [1, 0, 0]], dtype=np.float64)  # label 1: the positive training never saw
    smoothed = task_metrics(task, y_test, constant.predict(2))[0]["loss"]
    unsmoothed = task_metrics(task, y_test, np.tile(np.nanmean(y_train, axis=0), (2, 1)))[0]["loss"]
    assert unsmoothed > 6 and smoothed < 1.2  # 34.5 nats over 5 entries, against log 6 / 5
    assert smoothed_prevalence(np.array([nan, nan])) == 0.5  # never annotated: no information, not 0


def _site(x: np.ndarray, y: np.ndarray, task: TaskInfo = BINARY) -> SiteData:
    n = len(y)
    a, b = int(0.6 * n), int(0.8 * n)
    return SiteData(x_train=x[:a], y_train=y[:a], x_val=x[a:b], y_val=y[a:b], x_test=x[b:], y_test=y[b:],
                    feature_names=tuple(f"f{j}" for j in range(x.shape[1])) if x.ndim == 2 else (), task=task)


def test_pooled_reference_per_task_and_none_for_images() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(400, 3))
    binary = fit_pooled_reference(BINARY, x, (x[:, 0] + 0.3 * rng.normal(size=400) > 0).astype(np.int64), seed=0)
    assert isinstance(binary, PooledReference) and binary.what.startswith("logistic regression")
    assert binary.predict(x[:5]).shape == (5,)
    stays = np.exp(1.0 + 0.8 * x[:, 0] + 0.5 * rng.normal(size=400))
    skewed = fit_pooled_reference(REGRESSION, x, stays, seed=0)
    assert isinstance(skewed, PooledReference) and "log1p" in skewed.what and skewed.predict(x).min() >= 0
    plain = fit_pooled_reference(REGRESSION, x, x[:, 1] + 0.1 * rng.normal(size=400), seed=0)
    assert isinstance(plain, PooledReference) and plain.what.startswith("ridge regression on y")
    classes = fit_pooled_reference(TaskInfo("multiclass", 4), x, np.digitize(x[:, 0], [-1, 0, 5]), seed=0)
    assert isinstance(classes, PooledReference) and classes.predict(x[:3]).shape == (3, 4)  # class 3 never seen
    images = fit_pooled_reference(BINARY, rng.normal(size=(20, 1, 4, 4)), np.arange(20) % 2, seed=0)
    assert isinstance(images, NotFitted) and "images or signals" in images.why


def test_image_sites_get_the_pooled_rows_reason_without_pooling_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's reason for images is the one the pooled images would get, and no site's rows are copied."""
    rng = np.random.default_rng(4)
    sites = {f"s{i}": _site(rng.normal(size=(40, 1, 28, 28)).astype(np.float32), np.arange(40) % 2) for i in range(3)}
    expected = fit_pooled_reference(BINARY, np.concatenate([d.x_train for d in sites.values()]),
                                    np.concatenate([d.y_train for d in sites.values()]), seed=0)
    assert isinstance(expected, NotFitted)
    pooled: list[tuple[int, ...]] = []
    concatenate = np.concatenate
    monkeypatch.setattr(np, "concatenate", lambda arrays, *a, **k: pooled.append(np.shape(arrays[0])) or
                        concatenate(arrays, *a, **k))
    section = baselines_section(sites, {}, seed=0)["pooled_reference"]
    assert section == {"fitted": False, "why": expected.why}
    assert all(len(shape) < 4 for shape in pooled)  # labels pooled (the constants), never the images


def test_pooled_reference_is_deterministic_given_the_seed() -> None:
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(200, 4)), rng.integers(0, 2, size=200)
    fits = [fit_pooled_reference(BINARY, x, y, seed=7) for _ in range(2)]
    assert all(isinstance(f, PooledReference) for f in fits)
    first, second = (f.predict(x) for f in fits if isinstance(f, PooledReference))
    assert np.array_equal(first, second)


def _model_test(sites: dict[str, SiteData]) -> dict[str, float | None]:
    """Stand-in for a trained model's mean test metrics: the pooled reference, scored as the report scores."""
    return baselines_section(sites, {}, seed=0)["pooled_reference"]["mean"]["test"]


def test_site_alone_flag_fires_on_a_label_leaking_partition_only() -> None:
    """Sites whose label rate differs (one mostly 0, one mostly 1) and uninformative features: the site
    alone beats the model and the pooled constant, so the report says the partition leaks the label. An iid
    partition with informative features does not warn, even where the model is weak on one metric."""
    rng = np.random.default_rng(4)
    leaking = {name: _site(rng.normal(size=(300, 3)), (rng.random(300) < rate).astype(np.int64))
               for name, rate in (("mostly-0", 0.05), ("mostly-1", 0.95))}
    section = baselines_section(leaking, _model_test(leaking), seed=0)
    assert any(w.startswith("the site alone predicts the target better than the federated model") and LEAK in w
               for w in section["warnings"])
    iid = {}
    for name in ("a", "b"):
        x = rng.normal(size=(300, 3))
        iid[name] = _site(x, (x[:, 0] + 0.5 * rng.normal(size=300) > 0).astype(np.int64))
    section = baselines_section(iid, _model_test(iid), seed=0)
    assert not any(LEAK in w for w in section["warnings"])
    # A model no better than the constant on loss is named, without a leak claim.
    weak = baselines_section(iid, {"loss": 0.75, "accuracy": 0.9}, seed=0)["warnings"]
    assert len(weak) == 1 and "does not beat the constant for log-loss and accuracy on test loss" in weak[0]


def test_regression_section_scores_constants_reference_and_site_alone() -> None:
    rng = np.random.default_rng(5)
    sites = {}
    for name, scale in (("small", 1.0), ("large", 3.0)):
        x = rng.normal(size=(200, 2))
        sites[name] = _site(x, scale * np.exp(0.5 * x[:, 0] + 0.3 * rng.normal(size=200)), REGRESSION)
    section = baselines_section(sites, {"mse": 100.0, "mae": 0.1, "msle": 0.01}, seed=0)
    assert [c["name"] for c in section["constants"]] == ["MSE", "MAE", "MSLE", "MAPE"]
    assert section["pooled_reference"]["fitted"] and "ridge" in section["pooled_reference"]["what"]
    assert set(section["site_alone"]["mean"]["test"]) == {"mse", "mae", "msle", "mape"}
    beaten = [w for w in section["warnings"] if "does not beat" in w]
    assert len(beaten) == 1 and "constant for MSE on test mse" in beaten[0]  # not on MAE or MSLE
    for c in section["constants"]:
        for site, entry in c["per_site"].items():
            y = sites[site].y_test
            assert entry["metrics"]["test"] == task_metrics(REGRESSION, y, np.full(len(y), c["value"]))[0]
