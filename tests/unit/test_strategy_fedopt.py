"""FedAdam, FedAdagrad, FedYogi (docs/algorithms.md section 5): the worked table, buffers, state, parameters."""

from __future__ import annotations

import numpy as np
import pytest

from fedmqtt.errors import ConfigError
from fedmqtt.strategies import RoundInput, SiteUpdate, TensorSpec, build_strategy

MANIFEST = {
    "w": TensorSpec("w", (2,), "float64", frozenset({"TRAIN"})),
    "bn.running_mean": TensorSpec(
        "bn.running_mean", (1,), "float32", frozenset({"FLOATBUF", "NORM:BatchNorm1d"})
    ),
    "bn.running_var": TensorSpec(
        "bn.running_var", (1,), "float32", frozenset({"FLOATBUF", "NORM:BatchNorm1d"})
    ),
}
PARAMS = {"eta_g": 0.01, "tau": 0.001, "b1": 0.9}

# docs/algorithms.md 5 worked table: variant -> (v with v_0 = tau^2, w_{t+1}, v with v_0 = 0, w_{t+1})
TABLE = {
    "fedadam": ([0.04000099, 9.9e-7], [0.0099501262, 0.0], [0.04, 0.0], [0.0099502488, 0.0]),
    "fedadagrad": ([4.000001, 1e-6], [0.0009995001, 0.0], [4.0, 0.0], [0.0009995002, 0.0]),
    "fedyogi": ([0.040001, 1e-6], [0.0099501250, 0.0], [0.04, 0.0], [0.0099502488, 0.0]),
}


def _input(round_no: int = 1, current: dict[str, np.ndarray] | None = None) -> RoundInput:
    """w_t = [0, 0], client models [1, 2] and [3, -2], equal n; BN running_mean 1.0 and 3.0."""
    current = current or {"w": np.zeros(2), "bn.running_mean": np.zeros(1, np.float32)}
    updates = [
        SiteUpdate("s1", {"w": np.array([1.0, 2.0]), "bn.running_mean": np.array([1.0], np.float32)}, 10, 5),
        SiteUpdate("s2", {"w": np.array([3.0, -2.0]), "bn.running_mean": np.array([3.0], np.float32)}, 10, 5),
    ]
    return RoundInput(round_no, current, updates, {"s1": 10, "s2": 10}, MANIFEST)


@pytest.mark.parametrize("variant", sorted(TABLE))
@pytest.mark.parametrize("v_init", ["tau^2", "0"])
def test_worked_table(variant: str, v_init: str) -> None:
    """Delta = [2, 0], m = [0.2, 0]; v and w_{t+1} as printed, for v_0 = tau^2 and v_0 = 0 (Hwang et al.)."""
    # Prepare
    v_expected, w_expected = TABLE[variant][:2] if v_init == "tau^2" else TABLE[variant][2:]
    params = {**PARAMS, **({"b2": 0.99} if variant != "fedadagrad" else {})}
    if v_init == "0":
        params["v_init"] = 0.0
    rule = build_strategy(variant, params)
    # Execute
    new = rule.aggregate_train(_input()).weights
    # Assert
    state = rule.state_dict()
    np.testing.assert_allclose(state["m"]["w"], [0.2, 0.0], atol=1e-15)
    np.testing.assert_allclose(state["v"]["w"], v_expected, rtol=0, atol=1e-15)
    np.testing.assert_allclose(new["w"], w_expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("variant", sorted(TABLE))
def test_running_mean_is_the_plain_weighted_average(variant: str) -> None:
    """BN running_mean 1.0 and 3.0 becomes exactly 2.0, never moved by the moments; float32 kept."""
    new = build_strategy(variant, PARAMS).aggregate_train(_input()).weights
    assert new["bn.running_mean"].dtype == np.float32
    np.testing.assert_array_equal(new["bn.running_mean"], np.array([2.0], np.float32))


def test_running_var_with_far_current_is_the_weighted_average() -> None:
    """FedAdam on a running_var far from the uploads: the p_i average (1:3 weights), not an adaptive step."""
    # Prepare
    current = {"w": np.zeros(2), "bn.running_var": np.array([50.0], np.float32)}
    updates = [
        SiteUpdate("s1", {"w": np.array([1.0, 2.0]), "bn.running_var": np.array([1.0], np.float32)}, 1, 5),
        SiteUpdate("s2", {"w": np.array([3.0, -2.0]), "bn.running_var": np.array([2.0], np.float32)}, 3, 5),
    ]
    # Execute
    new = build_strategy("fedadam").aggregate_train(
        RoundInput(1, current, updates, {"s1": 1, "s2": 3}, MANIFEST)
    )
    # Assert
    np.testing.assert_array_equal(new.weights["bn.running_var"], np.array([1.75], np.float32))
    assert "bn.running_var" not in build_strategy("fedadam").state_dict()["m"]


def test_no_participant_keeps_model_and_moments() -> None:
    """A round nobody reported in changes neither w nor m, v."""
    # Prepare
    rule = build_strategy("fedadam", PARAMS)
    first = rule.aggregate_train(_input()).weights
    before = rule.state_dict()
    # Execute
    again = rule.aggregate_train(RoundInput(2, first, [], {"s1": 10, "s2": 10}, MANIFEST)).weights
    # Assert
    np.testing.assert_array_equal(again["w"], first["w"])
    np.testing.assert_array_equal(rule.state_dict()["m"]["w"], before["m"]["w"])
    np.testing.assert_array_equal(rule.state_dict()["v"]["w"], before["v"]["w"])


def test_uniform_weighting_option() -> None:
    """weighting = uniform (Reddi et al.) averages the deltas 1/|S|: n=(1,3) still gives Delta = [2, 0]."""
    # Prepare
    updates = [
        SiteUpdate("s1", {"w": np.array([1.0, 2.0])}, 1, 5),
        SiteUpdate("s2", {"w": np.array([3.0, -2.0])}, 3, 5),
    ]
    rule = build_strategy("fedadam", {**PARAMS, "weighting": "uniform"})
    # Execute
    rule.aggregate_train(RoundInput(1, {"w": np.zeros(2)}, updates, {"s1": 1, "s2": 3}, MANIFEST))
    # Assert
    np.testing.assert_allclose(rule.state_dict()["m"]["w"], [0.2, 0.0], atol=1e-15)


@pytest.mark.parametrize(
    ("variant", "params", "field"),
    [
        ("fedadam", {"eta_g": 0.0}, "eta_g"),
        ("fedyogi", {"tau": -1e-3}, "tau"),
        ("fedadam", {"b1": 1.0}, "b1"),
        ("fedyogi", {"b2": 1.5}, "b2"),
        ("fedadagrad", {"b2": 0.99}, "'b2'"),
        ("fedadam", {"v_init": -1.0}, "v_init"),
        ("fedadam", {"weighting": "sizes"}, "weighting"),
    ],
)
def test_bad_parameters_name_the_field(variant: str, params: dict[str, float], field: str) -> None:
    """Out-of-range values and unknown keys (FedAdagrad has no b2) are ConfigErrors naming the field."""
    with pytest.raises(ConfigError, match=f"^{variant}: ") as info:
        build_strategy(variant, params)
    assert field in str(info.value)


def test_second_round_uses_persisted_moments() -> None:
    """Round 2 starts from m, v of round 1: m = 0.9 * 0.2 + 0.1 * Delta_2."""
    # Prepare
    rule = build_strategy("fedadam", PARAMS)
    first = rule.aggregate_train(_input()).weights
    # Execute: the same client models again, so Delta_2 = [2, 0] - w_1
    rule.aggregate_train(_input(2, first))
    # Assert
    delta_2 = np.array([2.0, 0.0]) - first["w"]
    np.testing.assert_allclose(
        rule.state_dict()["m"]["w"], 0.9 * np.array([0.2, 0.0]) + 0.1 * delta_2, atol=1e-15
    )
