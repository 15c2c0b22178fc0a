"""SCAFFOLD (docs/algorithms.md section 7): the three-round toy table, the c invariant, buffers, extras."""

from __future__ import annotations

import numpy as np
import pytest

from fedmqtt.errors import ConfigError
from fedmqtt.strategies import RoundInput, Scaffold, SiteUpdate, TensorSpec

MANIFEST = {
    "w": TensorSpec("w", (1,), "float64", frozenset({"TRAIN"})),
    "bn.running_mean": TensorSpec(
        "bn.running_mean", (1,), "float32", frozenset({"FLOATBUF", "NORM:BatchNorm1d"})
    ),
}
A = {"s1": 1.0, "s2": 5.0}
LR, K = 0.1, 2

# docs/algorithms.md 7 table: (client results y, x, c_1, c_2, c)
TABLE = [
    ((0.19, 0.95), 0.57, -0.95, -4.75, -2.85),
    ((1.0127, 1.0507), 1.0317, -0.3135, -4.3035, -2.3085),
    ((1.404727, 1.406627), 1.405677, 0.129865, -3.869635, -1.869885),
]


def _local(a: float, x: float, c: float, c_i: float) -> tuple[list[float], float]:
    """K steps y <- y - lr (g(y) - c_i + c), g(y) = y - a; option II c_i_new = c_i - c + (x - y)/(K lr)."""
    path = [x]
    for _ in range(K):
        y = path[-1]
        path.append(y - LR * ((y - a) - c_i + c))
    return path, c_i - c + (x - path[-1]) / (K * LR)


def _update(site: str, y: float, delta_c: float, n: int = 10) -> SiteUpdate:
    return SiteUpdate(site, {"w": np.array([y])}, n, K, extras={"delta_c": {"w": np.array([delta_c])}})


def test_three_round_toy_table() -> None:
    """Uniform weights, N=2, eta_g=1: printed y, x, c_1, c_2, c; round 2 client 1: 0.57, 0.803, 1.0127."""
    # Prepare
    rule = Scaffold({"weighting": "uniform"})
    enrolled = {"s1": 10, "s2": 10}
    x, c, c_i = 0.0, 0.0, {"s1": 0.0, "s2": 0.0}
    for round_no, (y_exp, x_exp, c1_exp, c2_exp, c_exp) in enumerate(TABLE, start=1):
        runs = {site: _local(A[site], x, c, c_i[site]) for site in ("s1", "s2")}
        if round_no == 2:
            assert runs["s1"][0] == pytest.approx([0.57, 0.803, 1.0127], abs=1e-12)
        updates = [_update(site, path[-1], c_new - c_i[site]) for site, (path, c_new) in runs.items()]
        c_i = {site: c_new for site, (_, c_new) in runs.items()}  # committed: the server aggregates them
        # Execute
        result = rule.aggregate_train(RoundInput(round_no, {"w": np.array([x])}, updates, enrolled, MANIFEST))
        # Assert
        assert [runs[s][0][-1] for s in ("s1", "s2")] == pytest.approx(y_exp, abs=1e-9)
        assert float(result.weights["w"][0]) == pytest.approx(x_exp, abs=1e-9)
        assert (c_i["s1"], c_i["s2"]) == pytest.approx((c1_exp, c2_exp), abs=1e-9)
        assert float(result.extras["c"]["w"][0]) == pytest.approx(c_exp, abs=1e-9)
        assert float(result.extras["c"]["w"][0]) == pytest.approx(
            0.5 * c_i["s1"] + 0.5 * c_i["s2"], abs=1e-12
        )
        x, c = float(result.weights["w"][0]), float(result.extras["c"]["w"][0])


def test_partial_participation_keeps_the_invariant() -> None:
    """N=3, only clients 1 and 2 in round 1: x = 0.57, c = (-0.95 - 4.75)/3 = -1.9."""
    # Prepare
    updates = [_update("s1", 0.19, -0.95), _update("s2", 0.95, -4.75)]
    enrolled = {"s1": 10, "s2": 10, "s3": 10}
    # Execute
    result = Scaffold().aggregate_train(RoundInput(1, {"w": np.zeros(1)}, updates, enrolled, MANIFEST))
    # Assert
    assert float(result.weights["w"][0]) == pytest.approx(0.57, abs=1e-12)
    assert float(result.extras["c"]["w"][0]) == pytest.approx(-1.9, abs=1e-12)


def test_sample_weights_use_population_shares_for_c() -> None:
    """Default weighting: x uses p_i over S_t, c uses pi_i = n_i / n over every enrolled site."""
    # Prepare: n = (1, 3, 4), sites 1 and 2 report
    updates = [_update("s1", 1.0, 8.0, n=1), _update("s2", 2.0, 8.0, n=3)]
    enrolled = {"s1": 1, "s2": 3, "s3": 4}
    # Execute
    result = Scaffold().aggregate_train(RoundInput(1, {"w": np.zeros(1)}, updates, enrolled, MANIFEST))
    # Assert
    assert float(result.weights["w"][0]) == pytest.approx(0.25 * 1.0 + 0.75 * 2.0, abs=1e-12)
    assert float(result.extras["c"]["w"][0]) == pytest.approx((1 / 8) * 8.0 + (3 / 8) * 8.0, abs=1e-12)


def test_float_buffers_get_p_i_and_no_control_variate() -> None:
    """running_mean 1.0 and 3.0 with equal n -> 2.0 even with eta_g = 2; c has no buffer entry."""
    # Prepare
    current = {"w": np.zeros(1), "bn.running_mean": np.array([10.0], np.float32)}
    updates = [
        SiteUpdate(
            "s1",
            {"w": np.array([1.0]), "bn.running_mean": np.array([1.0], np.float32)},
            5,
            2,
            extras={"delta_c": {"w": np.zeros(1)}},
        ),
        SiteUpdate(
            "s2",
            {"w": np.array([3.0]), "bn.running_mean": np.array([3.0], np.float32)},
            5,
            2,
            extras={"delta_c": {"w": np.zeros(1)}},
        ),
    ]
    # Execute
    result = Scaffold({"eta_g": 2.0}).aggregate_train(
        RoundInput(1, current, updates, {"s1": 5, "s2": 5}, MANIFEST)
    )
    # Assert
    np.testing.assert_array_equal(result.weights["bn.running_mean"], np.array([2.0], np.float32))
    assert float(result.weights["w"][0]) == pytest.approx(4.0, abs=1e-12)  # x + 2 * mean delta
    assert set(result.extras["c"]) == {"w"}


def test_c_is_sent_even_when_nobody_reports() -> None:
    """An empty round leaves x and c unchanged and still returns c for the downlink (zeros at first)."""
    result = Scaffold().aggregate_train(RoundInput(1, {"w": np.array([0.5])}, [], {"s1": 1}, MANIFEST))
    np.testing.assert_array_equal(result.weights["w"], [0.5])
    np.testing.assert_array_equal(result.extras["c"]["w"], [0.0])


def test_missing_delta_c_is_an_error() -> None:
    """An update without extras['delta_c'] would break c = sum pi_i c_i: ValueError naming the site."""
    updates = [SiteUpdate("s1", {"w": np.array([1.0])}, 5, 2)]
    with pytest.raises(ValueError, match="'s1' lacks extras\\['delta_c'\\]"):
        Scaffold().aggregate_train(RoundInput(1, {"w": np.zeros(1)}, updates, {"s1": 5}, MANIFEST))


def test_eta_g_must_be_positive() -> None:
    """eta_g <= 0 is a ConfigError naming scaffold and eta_g."""
    with pytest.raises(ConfigError, match="scaffold: eta_g must be greater than 0"):
        Scaffold({"eta_g": 0.0})
