"""FedDyn (docs/algorithms.md section 6): the three-round toy table, partial participation, alpha_i, buffers."""

from __future__ import annotations

import numpy as np
import pytest

from fedmqtt.errors import ConfigError
from fedmqtt.strategies import FedDyn, RoundInput, SiteUpdate, TensorSpec

MANIFEST = {
    "w": TensorSpec("w", (1,), "float64", frozenset({"TRAIN"})),
    "bn.running_var": TensorSpec(
        "bn.running_var", (1,), "float32", frozenset({"FLOATBUF", "NORM:BatchNorm1d"})
    ),
}
A = (1.0, 5.0)

# docs/algorithms.md 6: (client models, s_1 s_2, S_bar, theta_avg, next theta_send, printed tolerance)
TABLE = [
    ((0.189, 0.945), (0.189, 0.945), 0.567, 0.567, 1.134, 1e-12),
    ((1.1051019, 1.8468135), (0.1601019, 1.6578135), 0.9089577, 1.4759577, 2.3849154, 5e-8),
    (
        (2.12014046349, 2.84783371425),
        (-0.10467303651, 2.12073181425),
        1.00802938887,
        2.48398708887,
        3.49201647774,
        5e-12,
    ),
]


def _local(
    a: float, theta_send: float, s: float, *, alpha: float, lr: float = 0.1, steps: int = 2
) -> list[float]:
    """GD on 0.5 (w - a)^2 + alpha <w, s> + (alpha/2)(w - theta_send)^2 from theta_send; returns the path."""
    path = [theta_send]
    for _ in range(steps):
        w = path[-1]
        path.append(w - lr * ((w - a) + alpha * s + alpha * (w - theta_send)))
    return path


def test_three_round_toy_table() -> None:
    """alpha=0.1, equal n, N=2: every printed client model, s_i, S_bar, theta_avg and theta_send."""
    # Prepare
    rule = FedDyn({"alpha": 0.1})
    enrolled = {"s1": 10, "s2": 10}
    alphas = [rule.site_hyper(site, enrolled)["alpha"] for site in ("s1", "s2")]
    assert alphas == [0.1, 0.1]  # equal sizes: alpha_i = alpha
    theta_send, s = 0.0, [0.0, 0.0]
    for round_no, (models_exp, s_exp, s_bar_exp, avg_exp, send_exp, tol) in enumerate(TABLE, start=1):
        paths = [_local(a, theta_send, s_k, alpha=alpha) for a, s_k, alpha in zip(A, s, alphas, strict=True)]
        if round_no == 2:
            assert paths[0][1] == pytest.approx(1.11871, abs=1e-12)  # the step done by hand in the doc
        models = [p[-1] for p in paths]
        s = [s_k + (m - theta_send) for s_k, m in zip(s, models, strict=True)]
        updates = [SiteUpdate(site, {"w": np.array([m])}, 10, 2) for site, m in zip(("s1", "s2"), models, strict=True)]
        # Execute
        result = rule.aggregate_train(
            RoundInput(round_no, {"w": np.array([theta_send])}, updates, enrolled, MANIFEST)
        )
        # Assert
        assert models == pytest.approx(models_exp, abs=tol)
        assert s == pytest.approx(s_exp, abs=tol)
        assert float(rule.state_dict()["s_bar"]["w"][0]) == pytest.approx(s_bar_exp, abs=tol)
        assert result.eval_weights is not None
        assert float(result.eval_weights["w"][0]) == pytest.approx(avg_exp, abs=tol)
        assert float(result.weights["w"][0]) == pytest.approx(send_exp, abs=tol)
        theta_send = float(result.weights["w"][0])


def test_partial_participation_divides_by_all_enrolled() -> None:
    """N=3, only clients 1 and 2 in round 1: S_bar = 0.378, theta_avg = 0.567, theta_send = 0.945."""
    # Prepare
    rule = FedDyn({"alpha": 0.1})
    updates = [
        SiteUpdate("s1", {"w": np.array([0.189])}, 10, 2),
        SiteUpdate("s2", {"w": np.array([0.945])}, 10, 2),
    ]
    enrolled = {"s1": 10, "s2": 10, "s3": 10}
    # Execute
    result = rule.aggregate_train(RoundInput(1, {"w": np.zeros(1)}, updates, enrolled, MANIFEST))
    # Assert
    assert float(rule.state_dict()["s_bar"]["w"][0]) == pytest.approx(0.378, abs=1e-12)
    assert result.eval_weights is not None
    assert float(result.eval_weights["w"][0]) == pytest.approx(0.567, abs=1e-12)
    assert float(result.weights["w"][0]) == pytest.approx(0.945, abs=1e-12)


def test_alpha_scaled_by_size_by_default() -> None:
    """alpha_i = alpha * n_bar / n_i (reference code); scale_alpha_by_size = false gives alpha to all."""
    enrolled = {"s1": 1, "s2": 3}  # n_bar = 2
    rule = FedDyn({"alpha": 0.01})
    assert rule.site_hyper("s1", enrolled)["alpha"] == pytest.approx(0.02, abs=1e-15)
    assert rule.site_hyper("s2", enrolled)["alpha"] == pytest.approx(0.01 * 2 / 3, abs=1e-15)
    assert FedDyn({"alpha": 0.01, "scale_alpha_by_size": False}).site_hyper("s1", enrolled) == {
        "alpha": 0.01, "max_grad_norm": 10.0}  # the paper's clipping, on by default


def test_float_buffers_get_the_plain_mean_without_correction() -> None:
    """running_var 1.0 and 2.0 (n = 1, 3) -> 1.5 in both the sent and the evaluated model, in round 2 too."""
    # Prepare
    rule = FedDyn({"alpha": 0.1})
    current = {"w": np.zeros(1), "bn.running_var": np.array([100.0], np.float32)}
    updates = [
        SiteUpdate("s1", {"w": np.array([1.0]), "bn.running_var": np.array([1.0], np.float32)}, 1, 2),
        SiteUpdate("s2", {"w": np.array([2.0]), "bn.running_var": np.array([2.0], np.float32)}, 3, 2),
    ]
    enrolled = {"s1": 1, "s2": 3}
    # Execute
    first = rule.aggregate_train(RoundInput(1, current, updates, enrolled, MANIFEST))
    second = rule.aggregate_train(RoundInput(2, first.weights, updates, enrolled, MANIFEST))
    # Assert
    for result in (first, second):
        assert result.eval_weights is not None
        np.testing.assert_array_equal(result.weights["bn.running_var"], np.array([1.5], np.float32))
        np.testing.assert_array_equal(result.eval_weights["bn.running_var"], np.array([1.5], np.float32))
    assert set(rule.state_dict()["s_bar"]) == {"w"}


def test_no_participant_keeps_send_and_evaluated_models() -> None:
    """An empty round returns theta_send unchanged and the last theta_avg for evaluation."""
    # Prepare
    rule = FedDyn({"alpha": 0.1})
    updates = [
        SiteUpdate("s1", {"w": np.array([0.189])}, 10, 2),
        SiteUpdate("s2", {"w": np.array([0.945])}, 10, 2),
    ]
    first = rule.aggregate_train(RoundInput(1, {"w": np.zeros(1)}, updates, {"s1": 10, "s2": 10}, MANIFEST))
    # Execute
    empty = rule.aggregate_train(RoundInput(2, first.weights, [], {"s1": 10, "s2": 10}, MANIFEST))
    # Assert
    assert empty.eval_weights is not None
    np.testing.assert_array_equal(empty.weights["w"], first.weights["w"])
    assert float(empty.eval_weights["w"][0]) == pytest.approx(0.567, abs=1e-12)


def test_alpha_must_be_positive() -> None:
    """alpha <= 0 is a ConfigError naming feddyn and alpha."""
    with pytest.raises(ConfigError, match="feddyn: alpha must be greater than 0"):
        FedDyn({"alpha": 0})
