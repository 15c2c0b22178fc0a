"""FedPxN (docs/algorithms.md section 4): FedBN's server, mu for the sites, the toy with mu = 0.5."""

from __future__ import annotations

import numpy as np
import pytest

from fedmqtt.errors import ConfigError
from fedmqtt.strategies import FedBN, FedPxN, RoundInput, SiteUpdate, TensorSpec

MANIFEST = {
    "u": TensorSpec("u", (1,), "float64", frozenset({"TRAIN"})),
    "g": TensorSpec("g", (1,), "float64", frozenset({"TRAIN", "NORM:BatchNorm1d"})),
}


def _toy_local(
    a: float, b: float, *, mu: float, lr: float = 0.1, steps: int = 2
) -> tuple[list[float], float]:
    """GD from u=0, g=1 on 0.5(u-a)^2 + 0.5(g-b)^2 + (mu/2)(u - 0)^2: the proximal term touches u only."""
    u_path, g = [0.0], 1.0
    for _ in range(steps):
        u = u_path[-1]
        u_path.append(u - lr * ((u - a) + mu * (u - 0.0)))
        g = g - lr * (g - b)  # NORM parameter: exactly zero proximal gradient
    return u_path, g


def test_toy_worked_example() -> None:
    """mu=0.5: u paths 0, 0.1, 0.185 and 0, 0.5, 0.925 -> 0.555; g = 1.19 and 0.81 as in FedBN."""
    # Prepare
    (path_1, g1), (path_2, g2) = _toy_local(1.0, 2.0, mu=0.5), _toy_local(5.0, 0.0, mu=0.5)
    assert path_1 == pytest.approx([0.0, 0.1, 0.185], abs=1e-12)
    assert path_2 == pytest.approx([0.0, 0.5, 0.925], abs=1e-12)
    assert (g1, g2) == pytest.approx((1.19, 0.81), abs=1e-12)
    updates = [
        SiteUpdate("s1", {"u": np.array([path_1[-1]])}, 4, 2),
        SiteUpdate("s2", {"u": np.array([path_2[-1]])}, 4, 2),
    ]
    # Execute
    rule = FedPxN({"mu": 0.5})
    new = rule.aggregate_train(
        RoundInput(1, {"u": np.zeros(1)}, updates, {"s1": 4, "s2": 4}, MANIFEST)
    ).weights
    # Assert
    assert float(new["u"][0]) == pytest.approx(0.555, abs=1e-12)
    assert rule.shared_names(MANIFEST) == FedBN().shared_names(MANIFEST) == ["u"]


def test_mu_goes_to_the_sites() -> None:
    """site_hyper carries mu; FedPxN inherits FedBN's options."""
    rule = FedPxN({"mu": 0.001, "norm_types": ["batchnorm"]})
    assert rule.site_hyper("s1", {"s1": 3}) == {"mu": 0.001}
    assert rule.name == "fedpxn"


def test_negative_mu_is_a_config_error() -> None:
    """mu < 0 names fedpxn and mu."""
    with pytest.raises(ConfigError, match="fedpxn: mu must be greater than or equal to 0"):
        FedPxN({"mu": -0.1})
