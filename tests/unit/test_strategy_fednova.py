"""FedNova (docs/algorithms.md section 8): unequal local steps, ||a_i||_1 formulas, buffers, tau_eff option."""

from __future__ import annotations

import numpy as np
import pytest

from fedmqtt.errors import ConfigError
from fedmqtt.strategies import FedNova, RoundInput, SiteUpdate, TensorSpec
from fedmqtt.strategies.fednova import a_norm_momentum, a_norm_proximal

MANIFEST = {
    "w": TensorSpec("w", (1,), "float64", frozenset({"TRAIN"})),
    "bn.running_var": TensorSpec(
        "bn.running_var", (1,), "float32", frozenset({"FLOATBUF", "NORM:BatchNorm1d"})
    ),
}


def _local(a: float, steps: int, *, lr: float = 0.1) -> float:
    """Plain GD from 0 on 0.5 (w - a)^2."""
    w = 0.0
    for _ in range(steps):
        w -= lr * (w - a)
    return w


def _updates(y1: float, y2: float, a1: float, a2: float) -> list[SiteUpdate]:
    return [
        SiteUpdate("s1", {"w": np.array([y1])}, 10, 2, extras={"a_norm": a1}),
        SiteUpdate("s2", {"w": np.array([y2])}, 10, 4, extras={"a_norm": a2}),
    ]


def test_worked_example_unequal_steps() -> None:
    """Client 2 runs 4 steps: y = (0.19, 1.7195), ||a|| = (2, 4), tau_eff = 3, x = 0.7873125 (not 0.95475)."""
    # Prepare
    y1, y2 = _local(1.0, 2), _local(5.0, 4)
    assert (y1, y2) == pytest.approx((0.19, 1.7195), abs=1e-12)
    inp = RoundInput(1, {"w": np.zeros(1)}, _updates(y1, y2, 2.0, 4.0), {"s1": 10, "s2": 10}, MANIFEST)
    # Execute
    new = FedNova().aggregate_train(inp).weights
    # Assert
    assert float(new["w"][0]) == pytest.approx(0.7873125, abs=1e-12)
    assert 0.5 * y1 + 0.5 * y2 == pytest.approx(0.95475, abs=1e-12)


def test_equal_work_is_fedavg() -> None:
    """Every ||a_i||_1 equal: FedNova gives FedAvg's 0.57."""
    inp = RoundInput(1, {"w": np.zeros(1)}, _updates(0.19, 0.95, 2.0, 2.0), {"s1": 10, "s2": 10}, MANIFEST)
    assert float(FedNova().aggregate_train(inp).weights["w"][0]) == pytest.approx(0.57, abs=1e-12)


def test_a_norm_formulas() -> None:
    """Momentum 0.9, 3 steps: 5.61; proximal with eta_l mu = 0.05, 3 steps: 2.8525; plain SGD: tau."""
    assert a_norm_momentum(3, 0.9) == pytest.approx(5.61, abs=1e-12)
    assert a_norm_proximal(3, 0.05) == pytest.approx(2.8525, abs=1e-12)
    assert a_norm_momentum(7, 0.0) == a_norm_proximal(7, 0.0) == 7.0
    # running forms of docs/algorithms.md 8
    counter = a = 0.0
    for _ in range(3):
        counter = 0.9 * counter + 1
        a += counter
    assert a == pytest.approx(a_norm_momentum(3, 0.9), abs=1e-12)


def test_tau_eff_steps_option() -> None:
    """tau_eff = steps uses sum p_i tau_i (reference code with mu > 0) instead of sum p_i ||a_i||_1."""
    # Prepare: ||a|| = (1, 2) but tau = (2, 4), so tau_eff doubles
    inp = RoundInput(1, {"w": np.zeros(1)}, _updates(0.19, 1.7195, 1.0, 2.0), {"s1": 10, "s2": 10}, MANIFEST)
    # Execute
    norm = FedNova().aggregate_train(inp).weights["w"][0]
    steps = FedNova({"tau_eff": "steps"}).aggregate_train(inp).weights["w"][0]
    # Assert
    assert float(steps) == pytest.approx(2 * float(norm), abs=1e-12)


def test_float_buffers_are_averaged_not_normalised() -> None:
    """running_var 1.0 and 3.0, equal n, unequal ||a||: exactly 2.0."""
    # Prepare
    current = {"w": np.zeros(1), "bn.running_var": np.array([7.0], np.float32)}
    updates = [
        SiteUpdate(
            "s1",
            {"w": np.array([0.19]), "bn.running_var": np.array([1.0], np.float32)},
            10,
            2,
            extras={"a_norm": 2.0},
        ),
        SiteUpdate(
            "s2",
            {"w": np.array([1.7195]), "bn.running_var": np.array([3.0], np.float32)},
            10,
            4,
            extras={"a_norm": 4.0},
        ),
    ]
    # Execute
    new = FedNova().aggregate_train(RoundInput(1, current, updates, {"s1": 10, "s2": 10}, MANIFEST)).weights
    # Assert
    np.testing.assert_array_equal(new["bn.running_var"], np.array([2.0], np.float32))


def test_missing_a_norm_falls_back_to_steps() -> None:
    """Without extras['a_norm'] the server uses tau_i (plain SGD): the worked example again."""
    updates = [
        SiteUpdate("s1", {"w": np.array([0.19])}, 10, 2),
        SiteUpdate("s2", {"w": np.array([1.7195])}, 10, 4),
    ]
    inp = RoundInput(1, {"w": np.zeros(1)}, updates, {"s1": 10, "s2": 10}, MANIFEST)
    assert float(FedNova().aggregate_train(inp).weights["w"][0]) == pytest.approx(0.7873125, abs=1e-12)


def test_bad_parameters() -> None:
    """An unknown tau_eff mode and gmf >= 1 are ConfigErrors naming the field."""
    with pytest.raises(ConfigError, match="fednova: tau_eff"):
        FedNova({"tau_eff": "epochs"})
    with pytest.raises(ConfigError, match="fednova: gmf must be less than 1"):
        FedNova({"gmf": 1.0})
