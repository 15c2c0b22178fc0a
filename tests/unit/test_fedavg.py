"""FedAvg: the worked examples of docs/algorithms.md section 1, buffer rules, order independence, shape checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fedmqtt.strategies import FedAvg, SiteUpdate, build_strategy
from fedmqtt.strategies.aggregate import check_update_shapes, sample_weights
from fedmqtt.strategies.base import RoundInput
from ps_daemon import effects as fx
from ps_daemon.config import DaemonConfig
from ps_daemon.events import SiteOnline, UpdateReceived
from ps_daemon.machine import Machine
from ps_daemon.model_init import hash_weights


def _aggregate(round_no, current, updates):
    """FedAvg's new weights for one round (no manifest: every tensor is shared)."""
    inp = RoundInput(round_no=round_no, current=current, updates=list(updates),
                     enrolled={u.site_id: u.n_samples for u in updates}, manifest={})
    return FedAvg().aggregate_train(inp).weights


def _update(site: str, n: int, **tensors: np.ndarray) -> SiteUpdate:
    return SiteUpdate(site_id=site, tensors=tensors, n_samples=n, local_steps=1)


def _toy_local_result(a: float, *, start: float = 0.0, lr: float = 0.1, steps: int = 2) -> float:
    """Plain GD on f_k(w) = 0.5 (w - a_k)^2, whose gradient is exactly w - a_k (docs/algorithms.md 0.7)."""
    w = start
    for _ in range(steps):
        w = w - lr * (w - a)
    return w


def test_worked_example_weights() -> None:
    """n=(1,3), w_1=[1,2], w_2=[3,0] gives 0.25*[1,2] + 0.75*[3,0] = [2.5, 0.5]."""
    # Prepare
    current = {"w": np.zeros(2, np.float32)}
    updates = [
        _update("site-1", 1, w=np.array([1.0, 2.0], np.float32)),
        _update("site-2", 3, w=np.array([3.0, 0.0], np.float32)),
    ]
    # Execute
    new = _aggregate(1, current, updates)
    # Assert
    np.testing.assert_array_equal(sample_weights(updates), [0.25, 0.75])
    assert new["w"].dtype == np.float32
    np.testing.assert_array_equal(new["w"], np.array([2.5, 0.5], np.float32))


def test_worked_example_batchnorm_buffers() -> None:
    """BN running_var (1.0, 2.0) -> 1.75 (same p_i); num_batches_tracked (10, 30) -> 30, int64, 0-d."""
    # Prepare
    current = {
        "bn.running_var": np.ones(1, np.float32),
        "bn.num_batches_tracked": np.array(0, np.int64),
    }
    updates = [
        _update(
            "site-1",
            1,
            **{
                "bn.running_var": np.array([1.0], np.float32),
                "bn.num_batches_tracked": np.array(10, np.int64),
            },
        ),
        _update(
            "site-2",
            3,
            **{
                "bn.running_var": np.array([2.0], np.float32),
                "bn.num_batches_tracked": np.array(30, np.int64),
            },
        ),
    ]
    # Execute
    new = _aggregate(1, current, updates)
    # Assert
    np.testing.assert_array_equal(new["bn.running_var"], np.array([1.75], np.float32))
    assert new["bn.running_var"].dtype == np.float32 and new["bn.running_var"].shape == (1,)
    counter = new["bn.num_batches_tracked"]
    assert counter.dtype == np.int64
    assert counter.shape == ()
    assert int(counter) == 30


def test_partial_participation_renormalises_over_the_reporting_sites() -> None:
    """N=3, n=(1,3,4), S={1,2}: weights (0.25, 0.75) and the same [2.5, 0.5] as the full example."""
    # Prepare: site 3 (n=4) was enrolled but did not report, so it is not among the updates
    enrolled = {"site-1": 1, "site-2": 3, "site-3": 4}
    tensors = {"site-1": [1.0, 2.0], "site-2": [3.0, 0.0], "site-3": [100.0, 100.0]}
    reported = ["site-1", "site-2"]
    updates = [_update(s, enrolled[s], w=np.array(tensors[s], np.float32)) for s in reported]
    # Execute
    new = _aggregate(1, {"w": np.zeros(2, np.float32)}, updates)
    # Assert
    np.testing.assert_array_equal(sample_weights(updates), [0.25, 0.75])
    np.testing.assert_array_equal(new["w"], np.array([2.5, 0.5], np.float32))


@pytest.mark.parametrize(("counts", "expected"), [((1, 1), 0.57), ((1, 3), 0.76)], ids=["equal-n", "n-1-3"])
def test_toy_round(counts: tuple[int, int], expected: float) -> None:
    """Two GD steps from 0 (lr 0.1) toward a=(1,5) give 0.19 and 0.95; FedAvg gives 0.57 or 0.76."""
    # Prepare
    local = [_toy_local_result(1.0), _toy_local_result(5.0)]
    assert local == pytest.approx([0.19, 0.95], abs=1e-12)  # the document's numbers, derived here
    updates = [
        _update(f"site-{i + 1}", n, w=np.array([w], np.float64))
        for i, (n, w) in enumerate(zip(counts, local, strict=True))
    ]
    # Execute
    new = _aggregate(1, {"w": np.zeros(1, np.float64)}, updates)
    # Assert
    closed_form = sum(n * w for n, w in zip(counts, local, strict=True)) / sum(counts)
    assert float(new["w"][0]) == pytest.approx(closed_form, abs=1e-12)
    assert float(new["w"][0]) == pytest.approx(expected, abs=1e-12)


def test_no_updates_leave_the_weights_unchanged() -> None:
    """With no update the global tensors come back equal (as copies, not the same arrays)."""
    current = {"w": np.array([1.5, -2.0], np.float32), "n": np.array(7, np.int64)}
    new = _aggregate(3, current, [])
    assert set(new) == set(current)
    for name, value in current.items():
        np.testing.assert_array_equal(new[name], value)
        assert new[name].dtype == value.dtype
        assert new[name] is not value


def test_zero_counts_fall_back_to_uniform_weights() -> None:
    """If every n_i is 0 the sites weigh equally instead of dividing by zero."""
    updates = [_update("a", 0, w=np.zeros(1)), _update("b", 0, w=np.zeros(1))]
    np.testing.assert_array_equal(sample_weights(updates), [0.5, 0.5])


def test_strategy_state_is_empty_and_registered_by_name() -> None:
    """FedAvg keeps no server state and is found by build_strategy('fedavg')."""
    strategy = build_strategy("fedavg")
    assert isinstance(strategy, FedAvg)
    assert strategy.state_dict() == {}
    strategy.load_state_dict({})


# -- order independence through the state machine ------------------------------------------------
SITES = ("site-a", "site-b", "site-c")
VALUES = {"site-a": 0.1, "site-b": 0.2, "site-c": 0.3}  # 0.1 + 0.2 + 0.3 depends on the order in float64


def _machine() -> Machine:
    config = DaemonConfig.model_validate(
        {
            "run_id": "r1",
            "sites": list(SITES),
            "rounds": 3,
            "model": {"name": "mlp", "args": {}},
            "credentials": "creds.toml",
        }
    )
    return Machine(config, FedAvg(), hash_weights)


def _aggregate_in_arrival_order(order: tuple[str, ...]) -> np.ndarray:
    machine = _machine()
    state = machine.initial_state({"w": np.zeros(1, np.float64)})
    for site in SITES:
        state, _ = machine.step(state, SiteOnline(site, now=0.0))
    for site in order:
        update = _update(site, 1, w=np.array([VALUES[site]], np.float64))
        state, effects = machine.step(state, UpdateReceived(site, 1.0, 1, state.model_hash, update))
    assert state.round == 2 and any(isinstance(e, fx.SaveCheckpoint) for e in effects)
    return state.weights["w"]


def test_aggregation_is_independent_of_arrival_order() -> None:
    """Updates fed to the Machine in every arrival order give bit-identical weights (it sorts by site id)."""
    # Prepare: the raw strategy does depend on the order it is given, so this data can show a difference
    direct = {
        _aggregate(1, {"w": np.zeros(1)}, [_update(s, 1, w=np.array([VALUES[s]])) for s in p])["w"]
        .tobytes()
        for p in itertools.permutations(SITES)
    }
    assert len(direct) > 1
    # Execute
    results = {_aggregate_in_arrival_order(order).tobytes() for order in itertools.permutations(SITES)}
    # Assert
    assert len(results) == 1
    sorted_result = _aggregate(
        1, {"w": np.zeros(1)}, [_update(s, 1, w=np.array([VALUES[s]])) for s in sorted(SITES)]
    )["w"]
    assert results == {sorted_result.tobytes()}


# -- shape checks ------------------------------------------------------------------------------------
CURRENT = {"fc.weight": np.zeros((2, 3), np.float32), "bn.num_batches_tracked": np.array(0, np.int64)}

SHAPE_CASES = [
    pytest.param(
        {"fc.weight": np.zeros((2, 3), np.float32)}, "missing ['bn.num_batches_tracked']", id="missing"
    ),
    pytest.param(
        {**CURRENT, "head.weight": np.zeros(2, np.float32)}, "unexpected ['head.weight']", id="extra"
    ),
    pytest.param(
        {**CURRENT, "fc.weight": np.zeros((3, 2), np.float32)},
        "tensor 'fc.weight': float32[3, 2] != global float32[2, 3]",
        id="shape",
    ),
    pytest.param(
        {**CURRENT, "fc.weight": np.zeros((2, 3), np.float64)},
        "tensor 'fc.weight': float64[2, 3] != global float32[2, 3]",
        id="dtype",
    ),
    pytest.param(
        {**CURRENT, "bn.num_batches_tracked": np.array(0.0, np.float32)},
        "tensor 'bn.num_batches_tracked': float32[] != global int64[]",
        id="int-buffer-as-float",
    ),
    pytest.param(
        {**CURRENT, "bn.num_batches_tracked": np.array([0], np.int64)},
        "int64[1] != global int64[]",
        id="0d-vs-1d",
    ),
]


@pytest.mark.parametrize(("tensors", "reason"), SHAPE_CASES)
def test_check_update_shapes_names_the_mismatch(tensors: dict[str, np.ndarray], reason: str) -> None:
    """An update that does not fit the global model gets a reason naming the tensor and the difference."""
    got = check_update_shapes(_update("site-a", 1, **tensors), CURRENT)
    assert got is not None
    assert reason in got


def test_check_update_shapes_accepts_a_matching_update() -> None:
    """Same names, shapes and dtypes: no reason."""
    assert check_update_shapes(_update("site-a", 1, **CURRENT), CURRENT) is None
