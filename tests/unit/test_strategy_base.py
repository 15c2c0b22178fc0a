"""Base (docs/algorithms.md section 13): nothing is shared and the server changes nothing."""

from __future__ import annotations

import numpy as np

from fedmqtt.strategies import RoundInput, SiteUpdate, TensorSpec, build_strategy

MANIFEST = {
    "fc.weight": TensorSpec("fc.weight", (1,), "float32", frozenset({"TRAIN"})),
    "head.weight": TensorSpec("head.weight", (1,), "float32", frozenset({"TRAIN", "HEAD"})),
}


def test_shares_nothing() -> None:
    """shared_names is empty whatever the tags."""
    assert build_strategy("base").shared_names(MANIFEST) == []


def test_aggregate_returns_current_unchanged() -> None:
    """Even if an update arrives, the result equals the current tensors (copies)."""
    current = {"fc.weight": np.array([0.5], np.float32)}
    updates = [SiteUpdate("s1", {"fc.weight": np.array([9.0], np.float32)}, 3, 1)]
    result = build_strategy("base").aggregate_train(RoundInput(1, current, updates, {"s1": 3}, MANIFEST))
    np.testing.assert_array_equal(result.weights["fc.weight"], current["fc.weight"])
    assert result.weights["fc.weight"] is not current["fc.weight"]
    assert build_strategy("base").state_dict() == {}
