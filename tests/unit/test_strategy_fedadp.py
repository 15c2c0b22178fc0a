"""FedAdp (docs/algorithms.md section 9): angles, Gompertz weights, second participation, zero norms, buffers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedmqtt.errors import ConfigError
from fedmqtt.strategies import FedAdp, RoundInput, SiteUpdate, TensorSpec
from fedmqtt.strategies.fedadp import gompertz, update_angles

MANIFEST = {
    "w": TensorSpec("w", (2,), "float64", frozenset({"TRAIN"})),
    "bn.running_mean": TensorSpec(
        "bn.running_mean", (1,), "float32", frozenset({"FLOATBUF", "NORM:BatchNorm1d"})
    ),
}
ENROLLED = {"s1": 1, "s2": 3}


def _input(g1: np.ndarray, g2: np.ndarray, round_no: int = 1) -> RoundInput:
    """w_t = 0, so w_i = -g_i (g_i = w_t - w_i is the descent direction)."""
    updates = [SiteUpdate("s1", {"w": -g1}, 1, 1), SiteUpdate("s2", {"w": -g2}, 3, 1)]
    return RoundInput(round_no, {"w": np.zeros(2)}, updates, ENROLLED, MANIFEST)


def test_gompertz_reference_values() -> None:
    """f(0) = 5.0, f(1) = 3.1606027941, f(pi/2) = 0.2799308564 (a = 5)."""
    assert gompertz(0.0) == pytest.approx(5.0, abs=1e-10)
    assert gompertz(1.0) == pytest.approx(3.1606027941, abs=1e-10)
    assert gompertz(math.pi / 2) == pytest.approx(0.2799308564, abs=1e-10)


def test_worked_example() -> None:
    """g_1=[1,0], g_2=[0,1], n=(1,3): theta, f, n exp(f), psi and w_{t+1} as printed."""
    # Prepare
    g1, g2 = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    rule = FedAdp()
    # Execute
    new = rule.aggregate_train(_input(g1, g2)).weights
    # Assert
    theta = update_angles([g1, g2], [0.25, 0.75])
    assert list(theta) == pytest.approx([1.2490457724, 0.3217505544], abs=1e-10)
    f = [gompertz(t) for t in theta]
    assert f == pytest.approx([1.2507234720, 5.0000000000], abs=1e-10)
    assert [n * math.exp(v) for n, v in zip((1, 3), f, strict=True)] == pytest.approx(
        [3.4928690367, 445.2394773074], abs=1e-10
    )
    np.testing.assert_allclose(new["w"], [-0.0077838584, -0.9922161416], rtol=0, atol=1e-10)
    assert rule.state_dict()["theta_bar"] == pytest.approx(
        {"s1": 1.2490457724, "s2": 0.3217505544}, abs=1e-10
    )
    assert rule.state_dict()["count"] == {"s1": 1, "s2": 1}


def test_second_participation_smooths_by_own_count() -> None:
    """New angles 0.5 and 1.0: theta_bar = (0.8745228862, 0.6608752772), f = (4.2314657848, 4.9785194137)."""
    # Prepare: round 1 as in the worked example
    rule = FedAdp()
    rule.aggregate_train(_input(np.array([1.0, 0.0]), np.array([0.0, 1.0])))
    # round 2: g_1 at +0.5 rad, g_2 at -1.0 rad from the x axis, scaled so g = 0.25 g_1 + 0.75 g_2 lies on it
    r2 = 1.0
    r1 = 3.0 * r2 * math.sin(1.0) / math.sin(0.5)
    g1 = r1 * np.array([math.cos(0.5), math.sin(0.5)])
    g2 = r2 * np.array([math.cos(-1.0), math.sin(-1.0)])
    assert list(update_angles([g1, g2], [0.25, 0.75])) == pytest.approx([0.5, 1.0], abs=1e-12)
    # Execute
    new = rule.aggregate_train(_input(g1, g2, round_no=2)).weights
    # Assert
    theta_bar = rule.state_dict()["theta_bar"]
    assert theta_bar == pytest.approx({"s1": 0.8745228862, "s2": 0.6608752772}, abs=1e-10)
    assert [gompertz(theta_bar[s]) for s in ("s1", "s2")] == pytest.approx(
        [4.2314657848, 4.9785194137], abs=1e-10
    )
    assert rule.state_dict()["count"] == {"s1": 2, "s2": 2}
    scores = np.array([1 * math.exp(gompertz(theta_bar["s1"])), 3 * math.exp(gompertz(theta_bar["s2"]))])
    psi = scores / scores.sum()
    np.testing.assert_allclose(new["w"], -(psi[0] * g1 + psi[1] * g2), rtol=0, atol=1e-12)


def test_count_is_per_client_participation() -> None:
    """A site absent in round 2 keeps t_i = 1; its next mean divides by 2, not by the round index."""
    # Prepare
    rule = FedAdp()
    rule.aggregate_train(_input(np.array([1.0, 0.0]), np.array([0.0, 1.0])))
    only_s2 = RoundInput(
        2, {"w": np.zeros(2)}, [SiteUpdate("s2", {"w": np.array([0.0, -1.0])}, 3, 1)], ENROLLED, MANIFEST
    )
    # Execute
    rule.aggregate_train(only_s2)
    # Assert
    assert rule.state_dict()["count"] == {"s1": 1, "s2": 2}
    assert rule.state_dict()["theta_bar"]["s2"] == pytest.approx((0.3217505544 + 0.0) / 2, abs=1e-10)


def test_zero_norm_update_gets_a_right_angle() -> None:
    """A site that did not move (||g_i|| = 0) gets theta = pi/2, not 0 (Plato)."""
    assert list(update_angles([np.zeros(2), np.array([1.0, 0.0])], [0.5, 0.5])) == pytest.approx(
        [math.pi / 2, 0.0], abs=1e-12
    )
    assert list(update_angles([np.zeros(2), np.zeros(2)], [0.5, 0.5])) == pytest.approx([math.pi / 2] * 2)


def test_float_buffers_get_psi_and_stay_out_of_the_angle() -> None:
    """An equal running_mean stays exactly that value; a huge buffer difference does not change psi."""

    # Prepare
    def run(buffer_2: float) -> dict[str, np.ndarray]:
        updates = [
            SiteUpdate(
                "s1", {"w": np.array([-1.0, 0.0]), "bn.running_mean": np.array([4.0], np.float32)}, 1, 1
            ),
            SiteUpdate(
                "s2", {"w": np.array([0.0, -1.0]), "bn.running_mean": np.array([buffer_2], np.float32)}, 3, 1
            ),
        ]
        current = {"w": np.zeros(2), "bn.running_mean": np.zeros(1, np.float32)}
        return FedAdp().aggregate_train(RoundInput(1, current, updates, ENROLLED, MANIFEST)).weights

    # Execute
    same, far = run(4.0), run(1e6)
    # Assert
    np.testing.assert_array_equal(same["bn.running_mean"], np.array([4.0], np.float32))
    np.testing.assert_array_equal(same["w"], far["w"])


def test_a_must_be_positive() -> None:
    """a <= 0 is a ConfigError naming fedadp and a."""
    with pytest.raises(ConfigError, match="fedadp: a must be greater than 0"):
        FedAdp({"a": -5})
