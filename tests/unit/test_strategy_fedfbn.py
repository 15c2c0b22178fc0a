"""FedFBN (docs/algorithms.md section 14): BN never sent, uniform mean, surgical aggregation of the output."""

from __future__ import annotations

import numpy as np
import pytest

from fedmqtt.errors import ConfigError
from fedmqtt.strategies import FedFBN, RoundInput, SiteUpdate, TensorSpec
from fedmqtt.strategies.fedfbn import surgical_aggregate

MANIFEST = {
    "conv.weight": TensorSpec("conv.weight", (2,), "float32", frozenset({"TRAIN"})),
    "bn.weight": TensorSpec(
        "bn.weight", (2,), "float32", frozenset({"NORM:BatchNorm2d"})
    ),  # frozen: no TRAIN
    "bn.running_mean": TensorSpec(
        "bn.running_mean", (2,), "float32", frozenset({"FLOATBUF", "NORM:BatchNorm2d"})
    ),
    "ln.weight": TensorSpec("ln.weight", (2,), "float32", frozenset({"TRAIN", "NORM:LayerNorm"})),
    "fc.weight": TensorSpec("fc.weight", (2, 2), "float32", frozenset({"TRAIN", "HEAD"})),
    "fc.bias": TensorSpec("fc.bias", (2,), "float32", frozenset({"TRAIN", "HEAD"})),
}
# docs/algorithms.md 14: client A has (L1, L2), client B has (L2, L3)
SITE_A = (["L1", "L2"], {"fc.weight": np.array([[1.0, 1.0], [2.0, 2.0]]), "fc.bias": np.array([0.1, 0.2])})
SITE_B = (["L2", "L3"], {"fc.weight": np.array([[4.0, 0.0], [5.0, 5.0]]), "fc.bias": np.array([0.4, 0.5])})


def test_only_batchnorm_stays_out() -> None:
    """Every tensor but BatchNorm's travels (LayerNorm included)."""
    assert FedFBN().shared_names(MANIFEST) == ["conv.weight", "fc.bias", "fc.weight", "ln.weight"]


def test_uniform_mean_ignores_sample_counts() -> None:
    """[1,2] and [3,0] with n=(1,3) give [2,1] (FedAvg would give [2.5,0.5])."""
    updates = [
        SiteUpdate("a", {"conv.weight": np.array([1.0, 2.0], np.float32)}, 1, 1),
        SiteUpdate("b", {"conv.weight": np.array([3.0, 0.0], np.float32)}, 3, 1),
    ]
    inp = RoundInput(1, {"conv.weight": np.zeros(2, np.float32)}, updates, {"a": 1, "b": 3}, MANIFEST)
    new = FedFBN().aggregate_train(inp).weights
    np.testing.assert_array_equal(new["conv.weight"], np.array([2.0, 1.0], np.float32))


def test_surgical_worked_example() -> None:
    """Global L1=[1,1],0.1; L2=[3,1],0.3; L3=[5,5],0.5; A receives (L1,L2), B receives (L2,L3)."""
    # Execute
    rows, personal = surgical_aggregate({"A": SITE_A, "B": SITE_B})
    # Assert
    expected = {"L1": ([1.0, 1.0], 0.1), "L2": ([3.0, 1.0], 0.3), "L3": ([5.0, 5.0], 0.5)}
    for label, (weight, bias) in expected.items():
        np.testing.assert_allclose(rows[label]["fc.weight"], weight, atol=1e-15)
        assert float(rows[label]["fc.bias"]) == pytest.approx(bias, abs=1e-15)
    np.testing.assert_allclose(personal["A"]["fc.weight"], [[1.0, 1.0], [3.0, 1.0]], atol=1e-15)
    np.testing.assert_allclose(personal["A"]["fc.bias"], [0.1, 0.3], atol=1e-15)
    np.testing.assert_allclose(personal["B"]["fc.weight"], [[3.0, 1.0], [5.0, 5.0]], atol=1e-15)
    np.testing.assert_allclose(personal["B"]["fc.bias"], [0.3, 0.5], atol=1e-15)


def test_label_nobody_uploaded_keeps_its_previous_rows() -> None:
    """With only A reporting, L3 keeps the global rows of the round before."""
    previous, _ = surgical_aggregate({"A": SITE_A, "B": SITE_B})
    rows, personal = surgical_aggregate({"A": SITE_A}, previous)
    np.testing.assert_allclose(rows["L3"]["fc.weight"], [5.0, 5.0])
    np.testing.assert_allclose(rows["L2"]["fc.weight"], [2.0, 2.0])
    assert set(personal) == {"A"}


def test_strategy_applies_surgical_aggregation_when_label_sets_are_sent() -> None:
    """With extras['label_set'] head rows go per site in `personal`; the body is still the uniform mean."""
    # Prepare
    updates = [
        SiteUpdate(
            site,
            {"conv.weight": np.array(conv, np.float32), **{k: v.astype(np.float32) for k, v in head.items()}},
            1,
            1,
            extras={"label_set": labels},
        )
        for site, conv, (labels, head) in (("A", [1.0, 2.0], SITE_A), ("B", [3.0, 0.0], SITE_B))
    ]
    current = {
        "conv.weight": np.zeros(2, np.float32),
        "fc.weight": np.zeros((2, 2), np.float32),
        "fc.bias": np.zeros(2, np.float32),
    }
    rule = FedFBN()
    # Execute
    result = rule.aggregate_train(RoundInput(1, current, updates, {"A": 1, "B": 1}, MANIFEST))
    # Assert
    np.testing.assert_array_equal(result.weights["conv.weight"], np.array([2.0, 1.0], np.float32))
    np.testing.assert_allclose(result.personal["A"]["fc.weight"], [[1.0, 1.0], [3.0, 1.0]])
    np.testing.assert_allclose(result.personal["B"]["fc.bias"], [0.3, 0.5], atol=1e-7)
    assert result.personal["B"]["fc.bias"].dtype == np.float32
    assert sorted(rule.state_dict()["label_rows"]) == ["L1", "L2", "L3"]


def test_identical_label_sets_average_the_head_like_the_rest() -> None:
    """Without label sets (or with masked_loss) the output layer is the uniform mean."""
    updates = [
        SiteUpdate("A", {"fc.bias": np.array([0.1, 0.2])}, 1, 1, extras={"label_set": ["L1", "L2"]}),
        SiteUpdate("B", {"fc.bias": np.array([0.3, 0.4])}, 5, 1, extras={"label_set": ["L2", "L3"]}),
    ]
    inp = RoundInput(1, {"fc.bias": np.zeros(2)}, updates, {"A": 1, "B": 5}, MANIFEST)
    result = FedFBN({"partial_labels": "masked_loss"}).aggregate_train(inp)
    np.testing.assert_allclose(result.weights["fc.bias"], [0.2, 0.3])
    assert not result.personal


def test_bad_partial_labels_mode() -> None:
    """An unknown partial_labels mode is a ConfigError naming fedfbn and the field."""
    with pytest.raises(ConfigError, match="fedfbn: partial_labels"):
        FedFBN({"partial_labels": "ignore"})
