"""FedPer (docs/algorithms.md section 12): HEAD tensors stay local, base tensors are averaged with p_i."""

from __future__ import annotations

import numpy as np

from fedmqtt.strategies import FedPer, RoundInput, SiteUpdate, TensorSpec

MANIFEST = {
    "base.weight": TensorSpec("base.weight", (2,), "float32", frozenset({"TRAIN"})),
    "head.weight": TensorSpec("head.weight", (1,), "float32", frozenset({"TRAIN", "HEAD"})),
    "head.bn.running_mean": TensorSpec(
        "head.bn.running_mean", (1,), "float32", frozenset({"FLOATBUF", "HEAD", "NORM:BatchNorm1d"})
    ),
}


def test_head_stays_local() -> None:
    """shared_names drops every HEAD tensor, buffers of head modules included."""
    assert FedPer().shared_names(MANIFEST) == ["base.weight"]


def test_worked_example() -> None:
    """base.weight [1,2],[3,0], n=(1,3) -> [2.5,0.5] for both; heads 0.7 and -0.2 never reach the server."""
    # Prepare
    current = {"base.weight": np.zeros(2, np.float32)}
    updates = [
        SiteUpdate("site-1", {"base.weight": np.array([1.0, 2.0], np.float32)}, 1, 1),
        SiteUpdate("site-2", {"base.weight": np.array([3.0, 0.0], np.float32)}, 3, 1),
    ]
    heads = {"site-1": np.float32(0.7), "site-2": np.float32(-0.2)}
    # Execute
    result = FedPer().aggregate_train(RoundInput(1, current, updates, {"site-1": 1, "site-2": 3}, MANIFEST))
    # Assert
    np.testing.assert_array_equal(result.weights["base.weight"], np.array([2.5, 0.5], np.float32))
    assert set(result.weights) == {"base.weight"} and not result.personal
    assert heads == {"site-1": np.float32(0.7), "site-2": np.float32(-0.2)}
