"""Local training and prediction for every task: losses, masking, determinism of each zoo model."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fedmqtt.data.base import BINARY, TaskInfo  # noqa: E402
from fedmqtt.errors import ConfigError  # noqa: E402
from fedmqtt.training.evaluate import evaluate_split, predict  # noqa: E402
from fedmqtt.training.loop import make_loss, resolve_loss, train_local  # noqa: E402
from fedmqtt.training.models import build_model  # noqa: E402
from fedmqtt.training.weights import initial_arrays, load_arrays, state_to_arrays  # noqa: E402
from schemas.messages import TrainSettings  # noqa: E402

MULTICLASS = TaskInfo("multiclass", 4)
MULTILABEL = TaskInfo("multilabel", 3, ("af", "rbbb", "sr"))
REGRESSION = TaskInfo("regression", 1)


def _labels(task: TaskInfo, n: int, rng: np.random.Generator) -> np.ndarray:
    if task.kind == "multiclass":
        return rng.integers(0, task.n_outputs, n)
    if task.kind == "multilabel":
        y = (rng.random((n, task.n_outputs)) < 0.4).astype(np.float32)
        y[rng.random(y.shape) < 0.3] = np.nan  # partial labels
        return y
    if task.kind == "regression":
        return rng.gamma(2.0, 2.0, n).astype(np.float32)
    return rng.integers(0, 2, n)


# (registry name, args, x shape of one row, task, loss)
RUNS: list[tuple[str, dict[str, Any], tuple[int, ...], TaskInfo, str]] = [
    ("lenet5", {"n_classes": 4, "norm": "bn", "dropout": 0.2}, (1, 28, 28), MULTICLASS, "auto"),
    ("gru", {"n_features": 3, "hidden": 6, "static_features": 2, "norm": "bn"}, (6, 5), BINARY, "auto"),
    ("transformer", {"n_features": 3, "d_model": 8, "heads": 2, "layers": 1, "norm": "bn"}, (6, 3),
     REGRESSION, "msle"),
    ("resnet1d_se", {"n_outputs": 3, "base": 4, "blocks": [1, 1], "norm": "gn"}, (12, 48), MULTILABEL,
     "auto"),
    ("mlp", {"in_features": 5, "out_features": 4, "norm": "ln"}, (5,), MULTICLASS, "ce"),
]


def _trained(
    name: str, args: dict[str, Any], row: tuple[int, ...], task: TaskInfo, loss: str
) -> tuple[Any, Any]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(13, *row)).astype(np.float32)  # 13 rows, batch 4: a trailing batch of 1 is dropped
    y = _labels(task, 13, rng)
    model = build_model(name, args)
    load_arrays(model, initial_arrays(name, args, seed=3))
    settings = TrainSettings(epochs=1, batch_size=4, lr=1e-2, loss=loss)  # type: ignore[arg-type]
    stats = train_local(model, x, y, settings, seed=5, task=task)
    return stats, state_to_arrays(model)


@pytest.mark.parametrize(("name", "args", "row", "task", "loss"), RUNS, ids=[r[0] for r in RUNS])
def test_training_each_model_is_bit_identical(
    name: str, args: dict[str, Any], row: tuple[int, ...], task: TaskInfo, loss: str
) -> None:
    """Two runs with the same seed end bit-identical; the trailing batch of one row is dropped."""
    (s1, w1), (s2, w2) = (_trained(name, args, row, task, loss) for _ in range(2))
    n_labelled = s1.n_samples
    assert s1.steps == n_labelled // 4 + (1 if n_labelled % 4 > 1 else 0)
    assert s1.mean_loss == s2.mean_loss and s1.mean_loss is not None and math.isfinite(s1.mean_loss)
    assert all(np.array_equal(w1[k], w2[k]) for k in w1)
    assert all(np.isfinite(v).all() for v in w1.values())


def test_resolve_loss_auto_and_mismatches() -> None:
    """auto: bce, ce, bce, mse; a loss that does not fit the task is a ConfigError."""
    kinds = [BINARY, MULTICLASS, MULTILABEL, REGRESSION]
    assert [resolve_loss("auto", t) for t in kinds] == ["bce", "ce", "bce", "mse"]
    assert resolve_loss("msle", REGRESSION) == "msle"
    for loss, task in [("ce", BINARY), ("bce", REGRESSION), ("msle", MULTICLASS), ("mse", MULTILABEL)]:
        with pytest.raises(ConfigError, match="does not fit"):
            resolve_loss(loss, task)


def test_masked_bce_averages_annotated_entries_only() -> None:
    """Partial labels: the loss is the mean over annotated entries; an all-NaN column adds nothing, no NaN."""
    logits = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.0, -3.0]], requires_grad=True)
    y = torch.tensor([[1.0, float("nan"), float("nan")], [0.0, 1.0, float("nan")]])
    loss = make_loss("bce")(logits, y)
    annotated = [(0.5, 1.0), (1.5, 0.0), (0.0, 1.0)]
    expected = np.mean([math.log1p(math.exp(-z if t == 1 else z)) for z, t in annotated])
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert torch.equal(logits.grad[:, 2], torch.zeros(2))  # the all-NaN column gets no gradient
    assert float(make_loss("bce")(logits[:, :2], y[:, :2]).detach()) == pytest.approx(float(loss.detach()))


def test_binary_bce_is_the_plain_mean() -> None:
    """Binary: BCE-with-logits of the single logit per row, averaged over the batch."""
    logits, y = torch.tensor([[0.3], [-0.7]]), torch.tensor([1.0, 0.0])
    expected = (math.log1p(math.exp(-0.3)) + math.log1p(math.exp(-0.7))) / 2
    assert float(make_loss("bce")(logits, y)) == pytest.approx(expected, rel=1e-6)


def test_msle_clamps_predictions_at_zero() -> None:
    """MSLE = mean (log1p(max(pred, 0)) - log1p(y))^2; a negative prediction counts as 0, but its gradient
    passes through the clamp (a zero gradient there would leave a negative start stuck for ever)."""
    pred = torch.tensor([[1.5], [-2.0], [5.0]], requires_grad=True)
    y = torch.tensor([1.0, 0.5, 4.0])
    loss = make_loss("msle")(pred, y)
    expected = np.mean([(math.log1p(1.5) - math.log1p(1.0)) ** 2, (0.0 - math.log1p(0.5)) ** 2,
                        (math.log1p(5.0) - math.log1p(4.0)) ** 2])
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert pred.grad is not None
    assert float(pred.grad[1, 0]) == pytest.approx(2 * (0.0 - math.log1p(0.5)) / 3, rel=1e-6)  # pushes it up
    assert float(make_loss("mse")(pred, y).detach()) == pytest.approx(np.mean([0.25, 6.25, 1.0]), rel=1e-6)


def test_multilabel_training_skips_unlabelled_rows_and_nan_columns() -> None:
    """Rows without any label are left out; an all-NaN label column leaves every weight finite."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 4)).astype(np.float32)
    y = np.full((10, 3), np.nan, dtype=np.float32)
    y[:7, 0] = rng.integers(0, 2, 7)
    y[:5, 1] = 1.0  # rows 7..9 have no label at all, column 2 none anywhere
    model = build_model("mlp", {"in_features": 4, "out_features": 3})
    stats = train_local(model, x, y, TrainSettings(batch_size=4), seed=0, task=MULTILABEL)
    assert stats.n_samples == 7 and stats.mean_loss is not None and math.isfinite(stats.mean_loss)
    assert all(np.isfinite(v).all() for v in state_to_arrays(model).values())


def test_msle_refuses_negative_targets_and_rows_must_match() -> None:
    """Negative targets cannot be trained with MSLE; x and y row counts must agree."""
    model = build_model("mlp", {"in_features": 2})
    x = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match="msle"):
        y = np.array([1.0, -1.0, 0, 0])
        train_local(model, x, y, TrainSettings(loss="msle"), seed=0, task=REGRESSION)
    with pytest.raises(ValueError, match="do not match"):
        train_local(model, x, np.zeros(3), TrainSettings(), seed=0)


def test_predict_shapes_per_task() -> None:
    """Binary (n,), multiclass softmax (n, C) summing to 1, multilabel sigmoid (n, L), regression clamps."""
    x = np.random.default_rng(0).normal(size=(7, 3)).astype(np.float32)
    multi = build_model("mlp", {"in_features": 3, "out_features": 4})
    proba = predict(multi, x, MULTICLASS, batch_size=3)
    assert proba.shape == (7, 4) and proba.dtype == np.float64
    np.testing.assert_allclose(proba.sum(axis=1), 1.0)
    labels = predict(build_model("mlp", {"in_features": 3, "out_features": 3}), x, MULTILABEL)
    assert labels.shape == (7, 3) and ((labels > 0) & (labels < 1)).all()
    reg = build_model("mlp", {"in_features": 3})
    with torch.no_grad():
        reg.head.bias.fill_(-100.0)
    assert (predict(reg, x, REGRESSION) < 0).all()
    assert (predict(reg, x, REGRESSION, nonnegative=True) == 0).all()
    assert predict(multi, x[:0], MULTICLASS).shape == (0, 4)
    assert predict(reg, x[:0], REGRESSION).shape == (0,)


def test_evaluate_split_uses_the_task_metrics() -> None:
    """evaluate_split on a multiclass model reports the multiclass metrics over the whole split."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 12, 32)).astype(np.float32).repeat(6, axis=0)
    model = build_model("resnet1d_se", {"n_outputs": 4, "base": 4, "blocks": [1], "norm": "bn"})
    values, reasons = evaluate_split(model, x, np.array([0, 1, 2, 0, 1, 2]), task=MULTICLASS)
    assert set(values) == {"auroc", "auprc", "accuracy", "balanced_accuracy", "loss"}
    assert values["auroc"] == pytest.approx(0.5) and reasons == {}  # identical rows: every score ties


def test_msle_learns_from_a_start_whose_outputs_are_all_negative(caplog: pytest.LogCaptureFixture) -> None:
    """A network whose every output starts below 0: MSLE still moves it toward the (positive) targets."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (2.0 + x[:, 0].clip(min=0)).astype(np.float32)
    model = torch.nn.Linear(4, 1)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.constant_(model.bias, -3.0)
    settings = TrainSettings(loss="msle", optimizer="sgd", lr=0.5, epochs=20, batch_size=16)
    first = train_local(model, x, y, settings, seed=0, task=REGRESSION)
    later = train_local(model, x, y, settings, seed=1, task=REGRESSION)
    assert float(model.bias.detach()) > 0 and later.mean_loss < 0.2 * first.mean_loss
    assert not [r for r in caplog.records if "moved no weight" in r.getMessage()]


def test_training_that_moves_no_weight_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    """Zero gradient everywhere (lr so small nothing moves in float32 counts too) is logged, not silent."""
    x = np.ones((8, 4), np.float32)
    y = np.zeros(8, np.float32)
    model = torch.nn.Linear(4, 1)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)  # MSE at 0 with target 0: the gradient is exactly zero
    with caplog.at_level("WARNING"):
        train_local(model, x, y, TrainSettings(loss="mse", batch_size=4), seed=0, task=REGRESSION)
    assert any("moved no weight" in r.getMessage() for r in caplog.records)


def test_balance_classes_leaves_a_single_class_site_its_plain_loss() -> None:
    """A site whose training labels are all positive (or all negative) has nothing to balance: weight 1, so its
    loss is the plain one and it still trains (n_neg / n_pos = 0 would make the loss identically 0)."""
    from fedmqtt.training.loop import balanced_loss

    logits = torch.tensor([[0.3], [-0.2], [0.1]])
    for y in (torch.ones(3), torch.zeros(3)):
        assert float(balanced_loss("bce", y, BINARY)(logits, y)) == pytest.approx(float(make_loss("bce")(logits, y)))
    multi = torch.tensor([[1.0, 0.0], [1.0, 1.0]])  # label 0: positives only; label 1: both
    plain = torch.nn.functional.binary_cross_entropy_with_logits(torch.zeros(2, 2), multi, reduction="none")
    got = balanced_loss("bce", multi, TaskInfo("multilabel", 2))(torch.zeros(2, 2), multi)
    assert float(got) == pytest.approx(float((plain * torch.tensor([1.0, 1.0])).mean()))


def test_balance_classes_weights_the_minority_and_is_off_by_default() -> None:
    """balance_classes = 1: BCE positives weigh n_neg/n_pos, CE classes n/(C n_c); default: the plain loss."""
    from fedmqtt.training.loop import balanced_loss

    y = torch.tensor([0.0] * 9 + [1.0])
    logits = torch.zeros(10, 1)
    plain = make_loss("bce")(logits, y)
    weighted = balanced_loss("bce", y, BINARY)(logits, y)
    assert float(weighted) == pytest.approx(float(plain) * (9 + 9) / 10, rel=1e-6)  # the positive counts 9x
    yc = torch.tensor([0, 0, 0, 1, 2, 2])
    ce = balanced_loss("ce", yc, TaskInfo("multiclass", 3))(torch.zeros(6, 3), yc)
    assert float(ce) == pytest.approx(math.log(3), rel=1e-6)  # mean with weights: uniform logits unchanged
    with pytest.raises(ValueError, match="regression"):
        balanced_loss("mse", torch.zeros(3), REGRESSION)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 15)).astype(np.float32)
    yb = (np.arange(40) < 4).astype(np.int64)
    ends = []
    for hyper in ({}, {"balance_classes": 0.0}, {"balance_classes": 1.0}):
        model = build_model("mlp", {"in_features": 15})
        torch.manual_seed(0)
        load_arrays(model, initial_arrays("mlp", {"in_features": 15}, 0))
        train_local(model, x, yb, TrainSettings(batch_size=8, hyper=hyper), seed=0)
        ends.append(np.concatenate([v.ravel() for v in state_to_arrays(model).values()]))
    assert np.array_equal(ends[0], ends[1]) and not np.array_equal(ends[0], ends[2])
