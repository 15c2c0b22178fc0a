"""FedAvg server rule (docs/algorithms.md section 1): worked examples, buffer rules, participation, dtypes."""

from __future__ import annotations

import numpy as np
import pytest

from fedmqtt.strategies import FedAvg, RoundInput, SiteUpdate, TensorSpec

MANIFEST = {
    "fc.weight": TensorSpec("fc.weight", (2,), "float32", frozenset({"TRAIN"})),
    "bn.running_var": TensorSpec(
        "bn.running_var", (1,), "float32", frozenset({"FLOATBUF", "NORM:BatchNorm1d"})
    ),
    "bn.num_batches_tracked": TensorSpec(
        "bn.num_batches_tracked", (), "int64", frozenset({"INTBUF", "NORM:BatchNorm1d"})
    ),
}


def _update(site: str, n: int, **tensors: np.ndarray) -> SiteUpdate:
    return SiteUpdate(site_id=site, tensors=tensors, n_samples=n, local_steps=2)


def _round(current: dict[str, np.ndarray], updates: list[SiteUpdate], enrolled: dict[str, int] | None = None):
    enrolled = enrolled if enrolled is not None else {u.site_id: u.n_samples for u in updates}
    return FedAvg().aggregate_train(RoundInput(1, current, updates, enrolled, MANIFEST))


def _toy_local(a: float, *, start: float = 0.0, lr: float = 0.1, steps: int = 2) -> float:
    """Plain GD on 0.5 (w - a)^2 (gradient w - a), docs/algorithms.md 0.7."""
    w = start
    for _ in range(steps):
        w -= lr * (w - a)
    return w


def test_worked_example_weights_and_buffers() -> None:
    """n=(1,3): [1,2],[3,0] -> [2.5,0.5]; running_var (1,2) -> 1.75; num_batches_tracked (10,30) -> 30."""
    # Prepare
    current = {
        "fc.weight": np.zeros(2, np.float32),
        "bn.running_var": np.ones(1, np.float32),
        "bn.num_batches_tracked": np.array(0, np.int64),
    }
    updates = [
        _update(
            "site-1",
            1,
            **{
                "fc.weight": np.array([1.0, 2.0], np.float32),
                "bn.running_var": np.array([1.0], np.float32),
                "bn.num_batches_tracked": np.array(10, np.int64),
            },
        ),
        _update(
            "site-2",
            3,
            **{
                "fc.weight": np.array([3.0, 0.0], np.float32),
                "bn.running_var": np.array([2.0], np.float32),
                "bn.num_batches_tracked": np.array(30, np.int64),
            },
        ),
    ]
    # Execute
    new = _round(current, updates).weights
    # Assert
    np.testing.assert_array_equal(new["fc.weight"], np.array([2.5, 0.5], np.float32))
    np.testing.assert_array_equal(new["bn.running_var"], np.array([1.75], np.float32))
    assert new["fc.weight"].dtype == np.float32 and new["bn.running_var"].dtype == np.float32
    assert new["bn.num_batches_tracked"].dtype == np.int64 and new["bn.num_batches_tracked"].shape == ()
    assert int(new["bn.num_batches_tracked"]) == 30


def test_partial_participation_renormalises_over_reporters() -> None:
    """N=3, n=(1,3,4), S={1,2}: weights (0.25, 0.75), same [2.5, 0.5]."""
    # Prepare
    enrolled = {"site-1": 1, "site-2": 3, "site-3": 4}
    updates = [
        _update("site-1", 1, **{"fc.weight": np.array([1.0, 2.0])}),
        _update("site-2", 3, **{"fc.weight": np.array([3.0, 0.0])}),
    ]
    # Execute
    new = _round({"fc.weight": np.zeros(2)}, updates, enrolled).weights
    # Assert
    np.testing.assert_allclose(new["fc.weight"], [2.5, 0.5], atol=1e-15)


@pytest.mark.parametrize(("counts", "expected"), [((1, 1), 0.57), ((1, 3), 0.76)], ids=["equal-n", "n-1-3"])
def test_toy_round(counts: tuple[int, int], expected: float) -> None:
    """Toy: local results 0.19 and 0.95; equal n gives 0.57, n=(1,3) gives 0.76."""
    # Prepare
    local = [_toy_local(1.0), _toy_local(5.0)]
    assert local == pytest.approx([0.19, 0.95], abs=1e-12)
    updates = [
        _update(f"site-{k + 1}", n, **{"fc.weight": np.array([w])})
        for k, (n, w) in enumerate(zip(counts, local, strict=True))
    ]
    # Execute
    new = _round({"fc.weight": np.zeros(1)}, updates).weights
    # Assert
    assert float(new["fc.weight"][0]) == pytest.approx(expected, abs=1e-12)


def test_no_participant_leaves_the_model_unchanged() -> None:
    """No update: equal copies of the current tensors, never the same arrays."""
    current = {
        "fc.weight": np.array([1.5, -2.0], np.float32),
        "bn.num_batches_tracked": np.array(7, np.int64),
    }
    new = _round(current, []).weights
    for name, value in current.items():
        np.testing.assert_array_equal(new[name], value)
        assert new[name].dtype == value.dtype and new[name] is not value


def test_shares_everything_and_keeps_no_state() -> None:
    """FedAvg shares every tensor, sends no per-site hyper-parameters and keeps no server state."""
    rule = FedAvg()
    assert rule.shared_names(MANIFEST) == sorted(MANIFEST)
    assert rule.site_hyper("site-1", {"site-1": 3}) == {}
    assert rule.state_dict() == {}
    rule.load_state_dict({})


def test_sums_run_in_the_given_site_order_in_float64() -> None:
    """0.1, 0.2, 0.3 with equal weights: the float64 sum in site order, cast once to float32."""
    # Prepare
    updates = [
        _update(s, 1, **{"fc.weight": np.array([v], np.float32)})
        for s, v in (("a", 0.1), ("b", 0.2), ("c", 0.3))
    ]
    # Execute
    new = _round({"fc.weight": np.zeros(1, np.float32)}, updates).weights
    # Assert
    third = 1.0 / 3.0
    expected = (
        third * np.float64(np.float32(0.1)) + third * np.float64(np.float32(0.2))
    ) + third * np.float64(np.float32(0.3))
    assert new["fc.weight"].dtype == np.float32
    assert new["fc.weight"][0] == np.float32(expected)
