"""A log target for skewed regression targets (learn log1p(y), read expm1) and an output head that starts at the
mean target instead of 0."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

torch = pytest.importorskip("torch")

from fedmqtt.data.base import TaskInfo  # noqa: E402
from fedmqtt.data.splits import SiteData  # noqa: E402
from fedmqtt.data.tables import FeatureSpec  # noqa: E402
from fedmqtt.training.evaluate import evaluate_split, predict  # noqa: E402
from fedmqtt.training.loop import train_local  # noqa: E402
from fedmqtt.training.models import build_model  # noqa: E402
from fedmqtt.training.targets import (  # noqa: E402
    from_model_scale,
    init_output_bias,
    output_layer,
    to_model_scale,
)
from fedmqtt.training.weights import initial_arrays, load_arrays, state_to_arrays  # noqa: E402
from schemas.messages import ModelSpec, TrainSettings  # noqa: E402
from site_agent.trainer import Trainer  # noqa: E402

LOG = TaskInfo("regression", 1, ("los",), target="log1p")
PLAIN = TaskInfo("regression", 1, ("los",))
GRU_ARGS = {"n_features": 3, "hidden": 8, "layers": 1, "static_features": 1}


def _los(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Sequences (n, 6 hours, 4 channels) and a skewed length of stay that depends on the first channel."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6, 4)).astype(np.float32)
    y = np.expm1(2.0 + 0.6 * x[:, :, 0].mean(axis=1) + rng.normal(0, 0.3, n)).astype(np.float32)
    return x, y


def _gru(seed: int = 1) -> torch.nn.Module:
    model = build_model("gru", GRU_ARGS)
    load_arrays(model, initial_arrays("gru", GRU_ARGS, seed=seed))
    return model


def test_scales_round_trip_and_refuse_negative_labels() -> None:
    y = np.array([0.0, 1.5, 30.0, np.nan], np.float32)
    z = to_model_scale(y, LOG)
    np.testing.assert_allclose(z[:3], np.log1p(y[:3]), rtol=1e-6)
    assert np.isnan(z[3])
    np.testing.assert_allclose(from_model_scale(torch.as_tensor(z[:3]), LOG).numpy(), y[:3], rtol=1e-5)
    assert to_model_scale(y, PLAIN) is y
    assert float(from_model_scale(torch.tensor([1e6]), LOG)) < 1e9  # capped: metrics stay finite
    with pytest.raises(ValueError, match="labels >= 0"):
        to_model_scale(np.array([-2.0], np.float32), LOG)


def test_log_target_trains_a_squared_error_on_log1p_whatever_the_loss_name() -> None:
    """The first batch's loss is mean((output - log1p y)^2): for "mse", "msle" and "auto" alike."""
    x, y = _los(32)
    losses = []
    for loss in ("mse", "msle", "auto"):
        model = _gru()
        with torch.no_grad():
            expected = float(torch.mean((model(torch.as_tensor(x)).reshape(-1) - torch.log1p(torch.as_tensor(y)))
                                        ** 2))
        settings = TrainSettings(epochs=1, batch_size=32, lr=1e-9, optimizer="sgd", loss=loss)  # type: ignore[arg-type]
        stats = train_local(model, x, y, settings, seed=0, task=LOG)
        losses.append(stats.mean_loss)
        assert stats.mean_loss == pytest.approx(expected, rel=1e-5)
    assert losses[0] == losses[1] == losses[2]


def test_predictions_come_back_on_the_labels_scale() -> None:
    x, y = _los(16)
    model = _gru()
    with torch.no_grad():
        raw = model(torch.as_tensor(x)).reshape(-1).double().numpy()
    np.testing.assert_allclose(predict(model, x, LOG), np.expm1(raw), rtol=1e-6)
    np.testing.assert_allclose(predict(model, x, PLAIN), raw, rtol=1e-6)
    metrics, _ = evaluate_split(model, x, y, task=LOG, nonnegative=True)
    assert metrics["mae"] == pytest.approx(float(np.mean(np.abs(np.maximum(np.expm1(raw), 0) - y))), rel=1e-5)


def test_output_bias_starts_at_the_mean_target_on_the_model_scale() -> None:
    x, y = _los(64)
    model = _gru()
    assert output_layer(model) is model.head
    value = init_output_bias(model, y, LOG)
    assert value == pytest.approx(float(np.mean(np.log1p(y.astype(np.float64)))), rel=1e-6)
    assert float(model.head.bias.detach()[0]) == pytest.approx(value, rel=1e-6)
    pred = np.log1p(predict(model, x, LOG))
    assert abs(pred.mean() - value) < 0.5 and pred.std() > 1e-4  # around the mean, and not constant
    assert init_output_bias(model, y, TaskInfo("binary", 1)) is None
    wide = build_model("mlp", {"in_features": 3, "out_features": 2})
    assert init_output_bias(wide, y, PLAIN) is None  # two outputs: not a regression head


def test_a_head_far_below_the_targets_still_learns() -> None:
    """Started at -10 on the log scale (predictions of -1 day, clamped to 0), the head gets a gradient and moves
    up: the log target has no clamp in its loss, so nothing can leave it dead."""
    x, y = _los(64)
    model = _gru()
    with torch.no_grad():
        model.head.bias.fill_(-10.0)
    settings = TrainSettings(epochs=20, batch_size=16, lr=0.05, optimizer="adam", loss="msle")
    train_local(model, x, y, settings, seed=0, task=LOG)
    assert float(model.head.bias.detach()[0]) > -9.0


def test_site_trainer_sets_the_bias_in_round_one_only(tmp_path: Path) -> None:
    x, y = _los(40)
    data = SiteData(x[:30], y[:30], x[30:35], y[30:35], x[35:], y[35:], ("a", "b", "c", "age"), task=LOG)
    spec = ModelSpec(name="gru", args=GRU_ARGS)
    weights = initial_arrays("gru", GRU_ARGS, seed=1)
    settings = TrainSettings(epochs=1, batch_size=16, lr=1e-9, optimizer="sgd", loss="msle")
    first = Trainer("s", data).train(spec, weights, settings, 1)
    mean_log = float(np.mean(np.log1p(y[:30].astype(np.float64))))
    assert float(first.weights["head.bias"][0]) == pytest.approx(mean_log, abs=1e-4)
    later = Trainer("s", data).train(spec, weights, settings, 2)
    assert float(later.weights["head.bias"][0]) == pytest.approx(float(weights["head.bias"][0]), abs=1e-4)
    assert state_to_arrays(_gru())["head.bias"].shape == (1,)


def test_specs_select_the_log_target() -> None:
    from fedmqtt.data.spec import Physionet2012Options

    assert Physionet2012Options(target="los").log_scale  # on by default for length of stay
    spec = FeatureSpec(label="los", task="regression", numeric=("a",), log_target=True)
    assert spec.task_info().target == "log1p"
    assert FeatureSpec(label="los", task="regression", numeric=("a",)).task_info().target == "identity"
    with pytest.raises(ValidationError, match="log_target is for regression"):
        FeatureSpec(label="y", numeric=("a",), log_target=True)
