"""FedProx (docs/algorithms.md section 2): FedAvg's server, mu in every task, the toy with mu = 0.5."""

from __future__ import annotations

import numpy as np
import pytest

from fedmqtt.errors import ConfigError
from fedmqtt.strategies import FedAvg, FedProx, RoundInput, SiteUpdate, TensorSpec, build_strategy

MANIFEST = {"w": TensorSpec("w", (1,), "float64", frozenset({"TRAIN"}))}


def _prox_local(a: float, *, mu: float, anchor: float = 0.0, lr: float = 0.1, steps: int = 2) -> list[float]:
    """GD on 0.5 (w - a)^2 + (mu/2)(w - anchor)^2: gradient (w - a) + mu (w - anchor); returns the path."""
    path = [anchor]
    for _ in range(steps):
        w = path[-1]
        path.append(w - lr * ((w - a) + mu * (w - anchor)))
    return path


def test_toy_worked_example() -> None:
    """mu=0.5: client 1 goes 0, 0.1, 0.185; client 2 goes 0, 0.5, 0.925; server 0.555 (FedAvg 0.57)."""
    # Prepare
    path_1, path_2 = _prox_local(1.0, mu=0.5), _prox_local(5.0, mu=0.5)
    assert path_1 == pytest.approx([0.0, 0.1, 0.185], abs=1e-12)
    assert path_2 == pytest.approx([0.0, 0.5, 0.925], abs=1e-12)
    updates = [
        SiteUpdate("site-1", {"w": np.array([path_1[-1]])}, 10, 2),
        SiteUpdate("site-2", {"w": np.array([path_2[-1]])}, 10, 2),
    ]
    inp = RoundInput(1, {"w": np.zeros(1)}, updates, {"site-1": 10, "site-2": 10}, MANIFEST)
    # Execute
    new = FedProx({"mu": 0.5}).aggregate_train(inp).weights
    # Assert
    assert float(new["w"][0]) == pytest.approx(0.555, abs=1e-12)
    assert _prox_local(1.0, mu=0.0)[-1] == pytest.approx(0.19, abs=1e-12)  # mu = 0 is FedAvg's 0.19


def test_server_is_fedavg_and_mu_goes_to_every_site() -> None:
    """FedProx is a FedAvg with name 'fedprox'; site_hyper carries mu (default 0.01)."""
    rule = build_strategy("fedprox")
    assert isinstance(rule, FedProx) and isinstance(rule, FedAvg) and rule.name == "fedprox"
    assert rule.site_hyper("site-1", {"site-1": 5}) == {"mu": 0.01}
    assert FedProx({"mu": 0.5}).site_hyper("x", {}) == {"mu": 0.5}


def test_first_round_skip_option_is_forwarded() -> None:
    """prox_skip_first_round (Hwang et al.) travels to the sites as 1.0 only when it is on."""
    assert FedProx({"mu": 0.1, "prox_skip_first_round": True}).site_hyper("x", {}) == {
        "mu": 0.1,
        "prox_skip_first_round": 1.0,
    }


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"mu": -1}, "fedprox: mu must be greater than or equal to 0 (got -1)"),
        ({"nu": 1.0}, "unknown parameter 'nu'"),
    ],
)
def test_bad_parameters_name_algorithm_and_field(params: dict[str, float], message: str) -> None:
    """A negative mu or an unknown key is a ConfigError naming fedprox and the field."""
    with pytest.raises(ConfigError, match="^fedprox: ") as info:
        FedProx(params)
    assert message in str(info.value)
