"""FedDkw (docs/algorithms.md section 10): KL weights, pooled histograms, kl_floor, missing histograms."""

from __future__ import annotations

import numpy as np
import pytest

from fedmqtt.errors import ConfigError
from fedmqtt.strategies import FedDkw, RoundInput, SiteUpdate, TensorSpec
from fedmqtt.strategies.feddkw import kl_divergence, mean_distribution, pooled_distribution

MANIFEST = {
    "w": TensorSpec("w", (1,), "float64", frozenset({"TRAIN"})),
    "bn.running_mean": TensorSpec(
        "bn.running_mean", (1,), "float32", frozenset({"FLOATBUF", "NORM:BatchNorm1d"})
    ),
}
OMEGA = (0.4653012654, 0.5346987346)


def _update(site: str, w: float, histogram: object | None, n: int = 10) -> SiteUpdate:
    extras = {} if histogram is None else {"label_histogram": histogram}
    return SiteUpdate(site, {"w": np.array([w])}, n, 2, extras=extras)


def test_worked_example_kl_and_weights() -> None:
    """h=[8,2],[5,5]: P_g=[0.65,0.35], KL=(0.0541883342, 0.0471553397), omega=(0.4653012654, 0.5346987346)."""
    # Prepare
    h1, h2 = {"0": 8.0, "1": 2.0}, {"0": 5.0, "1": 5.0}
    pooled = pooled_distribution([h1, h2])
    # Execute: the toy round's local results 0.19 and 0.95 (w_t = 0)
    rule = FedDkw()
    updates = [_update("s1", 0.19, {"0": 8, "1": 2}), _update("s2", 0.95, [5, 5])]
    new = rule.aggregate_train(
        RoundInput(1, {"w": np.zeros(1)}, updates, {"s1": 10, "s2": 10}, MANIFEST)
    ).weights
    # Assert
    assert pooled == pytest.approx({"0": 0.65, "1": 0.35}, abs=1e-12)
    assert kl_divergence(h1, pooled) == pytest.approx(0.0541883342, abs=1e-10)
    assert kl_divergence(h2, pooled) == pytest.approx(0.0471553397, abs=1e-10)
    assert list(rule.weights_of(updates)) == pytest.approx(OMEGA, abs=1e-10)
    assert float(new["w"][0]) == pytest.approx(OMEGA[0] * 0.19 + OMEGA[1] * 0.95, abs=1e-10)


def test_histograms_persist_and_sample_size_is_ignored() -> None:
    """Round 2 without histograms reuses the stored ones; n_i does not enter omega (default)."""
    # Prepare
    rule = FedDkw()
    first = [_update("s1", 0.0, [8, 2], n=1), _update("s2", 0.0, [5, 5], n=100)]
    rule.aggregate_train(RoundInput(1, {"w": np.zeros(1)}, first, {"s1": 1, "s2": 100}, MANIFEST))
    # Execute
    second = [_update("s1", 1.0, None, n=1), _update("s2", 2.0, None, n=100)]
    new = rule.aggregate_train(
        RoundInput(2, {"w": np.zeros(1)}, second, {"s1": 1, "s2": 100}, MANIFEST)
    ).weights
    # Assert
    assert rule.state_dict()["histograms"] == {"s1": {"0": 8.0, "1": 2.0}, "s2": {"0": 5.0, "1": 5.0}}
    assert float(new["w"][0]) == pytest.approx(OMEGA[0] * 1.0 + OMEGA[1] * 2.0, abs=1e-10)


def test_multiply_by_n_option() -> None:
    """multiply_by_n weights n_i / KL_i."""
    rule = FedDkw({"multiply_by_n": True})
    updates = [_update("s1", 0.0, [8, 2], n=1), _update("s2", 0.0, [5, 5], n=3)]
    rule.aggregate_train(RoundInput(1, {"w": np.zeros(1)}, updates, {"s1": 1, "s2": 3}, MANIFEST))
    raw = np.array([1 / 0.0541883342, 3 / 0.0471553397])
    assert list(rule.weights_of(updates)) == pytest.approx(list(raw / raw.sum()), abs=1e-9)


def test_kl_floor_caps_a_perfectly_matching_site() -> None:
    """A site equal to the pooled distribution has KL = 0: floored 1/KL is finite and dominant."""
    rule = FedDkw({"kl_floor": 1e-6})
    updates = [_update("s1", 0.0, [5, 5]), _update("s2", 0.0, [9, 1]), _update("s3", 1.0, [1, 9])]
    rule.aggregate_train(RoundInput(1, {"w": np.zeros(1)}, updates, {"s1": 10, "s2": 10, "s3": 10}, MANIFEST))
    omega = rule.weights_of(updates)  # P_g = [0.5, 0.5] = q_1, so KL_1 = 0
    assert np.all(np.isfinite(omega)) and omega[0] > 0.999 and omega[1] == omega[2]


def test_site_without_any_histogram_does_not_take_part() -> None:
    """An update whose site never shared a histogram gets weight 0; nobody left means no change."""
    # Prepare
    rule = FedDkw()
    updates = [_update("s1", 3.0, [8, 2]), _update("s2", 100.0, None)]
    # Execute
    new = rule.aggregate_train(
        RoundInput(1, {"w": np.zeros(1)}, updates, {"s1": 10, "s2": 10}, MANIFEST)
    ).weights
    lone = FedDkw().aggregate_train(
        RoundInput(1, {"w": np.zeros(1)}, [_update("s2", 5.0, None)], {"s2": 1}, MANIFEST)
    )
    # Assert
    assert float(new["w"][0]) == pytest.approx(3.0, abs=1e-12)
    assert float(lone.weights["w"][0]) == 0.0


def test_float_buffers_get_omega() -> None:
    """running_mean 1.0 and 3.0 -> omega_1 * 1 + omega_2 * 3 (float32)."""
    current = {"w": np.zeros(1), "bn.running_mean": np.zeros(1, np.float32)}
    updates = [
        SiteUpdate(
            "s1",
            {"w": np.zeros(1), "bn.running_mean": np.array([1.0], np.float32)},
            1,
            1,
            extras={"label_histogram": [8, 2]},
        ),
        SiteUpdate(
            "s2",
            {"w": np.zeros(1), "bn.running_mean": np.array([3.0], np.float32)},
            1,
            1,
            extras={"label_histogram": [5, 5]},
        ),
    ]
    new = FedDkw().aggregate_train(RoundInput(1, current, updates, {"s1": 1, "s2": 1}, MANIFEST)).weights
    assert new["bn.running_mean"].dtype == np.float32
    assert float(new["bn.running_mean"][0]) == pytest.approx(OMEGA[0] + 3 * OMEGA[1], abs=1e-6)


def test_kl_floor_must_be_positive() -> None:
    """kl_floor <= 0 is a ConfigError naming feddkw and kl_floor."""
    with pytest.raises(ConfigError, match="feddkw: kl_floor must be greater than 0"):
        FedDkw({"kl_floor": 0.0})


def test_global_distribution_pooled_or_mean_of_sites() -> None:
    """h=[80,20],[5,5]: pooled P_g=[85,25]/110 (sizes count); mean P_g=[0.65,0.35] (each site alike)."""
    h1, h2 = {"0": 80.0, "1": 20.0}, {"0": 5.0, "1": 5.0}
    updates = [_update("s1", 1.0, h1, n=100), _update("s2", 0.0, h2, n=10)]
    inp = RoundInput(1, {"w": np.zeros(1)}, updates, {"s1": 100, "s2": 10}, MANIFEST)
    results = {}
    for how, p_g in (("pooled", {"0": 85 / 110, "1": 25 / 110}), ("mean", {"0": 0.65, "1": 0.35})):
        rule = FedDkw({"global_distribution": how})
        inverse = np.array([1 / kl_divergence(h, p_g) for h in (h1, h2)])
        results[how] = float(rule.aggregate_train(inp).weights["w"][0])
        assert results[how] == pytest.approx(inverse[0] / inverse.sum(), abs=1e-12)
    assert mean_distribution([h1, h2]) == pytest.approx({"0": 0.65, "1": 0.35}, abs=1e-12)
    assert results["pooled"] != pytest.approx(results["mean"], abs=1e-3)  # the choice matters here
    assert FedDkw().params.global_distribution == "pooled"
    with pytest.raises(ConfigError, match="global_distribution"):
        FedDkw({"global_distribution": "median"})
