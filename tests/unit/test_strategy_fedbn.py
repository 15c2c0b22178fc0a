"""FedBN (docs/algorithms.md section 3): NORM tensors stay local, the rest is averaged; norm_types, weighting."""

from __future__ import annotations

import numpy as np
import pytest

from fedmqtt.errors import ConfigError
from fedmqtt.strategies import FedBN, RoundInput, SiteUpdate, TensorSpec


def _spec(name: str, *tags: str, dtype: str = "float32") -> TensorSpec:
    return TensorSpec(name, (1,), dtype, frozenset(tags))


MANIFEST = {
    "fc.weight": TensorSpec("fc.weight", (2,), "float32", frozenset({"TRAIN"})),
    "bn.weight": _spec("bn.weight", "TRAIN", "NORM:BatchNorm1d"),
    "bn.bias": _spec("bn.bias", "TRAIN", "NORM:BatchNorm1d"),
    "bn.running_mean": _spec("bn.running_mean", "FLOATBUF", "NORM:BatchNorm1d"),
    "bn.num_batches_tracked": _spec("bn.num_batches_tracked", "INTBUF", "NORM:BatchNorm1d", dtype="int64"),
    "gn.weight": _spec("gn.weight", "TRAIN", "NORM:GroupNorm"),
    "ln.weight": _spec("ln.weight", "TRAIN", "NORM:LayerNorm"),
}


def _toy_local(a: float, b: float, *, lr: float = 0.1, steps: int = 2) -> tuple[float, float]:
    """GD on 0.5 (u - a)^2 + 0.5 (g - b)^2 from u = 0, g = 1 (docs/algorithms.md 3 toy)."""
    u, g = 0.0, 1.0
    for _ in range(steps):
        u, g = u - lr * (u - a), g - lr * (g - b)
    return u, g


def test_shared_names_leave_every_normalization_layer_local_by_default() -> None:
    """Default norm_types = all: BN, GN and LN tensors (affine and buffers) are local."""
    assert FedBN().shared_names(MANIFEST) == ["fc.weight"]


def test_batchnorm_only_option_shares_group_and_layer_norm() -> None:
    """norm_types = ['batchnorm'] (original FedBN) keeps only BatchNorm local."""
    assert FedBN({"norm_types": ["batchnorm"]}).shared_names(MANIFEST) == [
        "fc.weight",
        "gn.weight",
        "ln.weight",
    ]
    assert FedBN({"norm_types": "all"}).shared_names(MANIFEST) == ["fc.weight"]


def test_worked_example_shared_average_and_local_norm_untouched() -> None:
    """fc.weight [1,2],[3,0], n=(1,3) -> [2.5,0.5]; the server never changes NORM values it holds."""
    # Prepare: current carries the round-1 NORM values too; sites send only shared tensors
    current = {"fc.weight": np.zeros(2, np.float32), "bn.weight": np.ones(1, np.float32)}
    updates = [
        SiteUpdate("site-1", {"fc.weight": np.array([1.0, 2.0], np.float32)}, 1, 2),
        SiteUpdate("site-2", {"fc.weight": np.array([3.0, 0.0], np.float32)}, 3, 2),
    ]
    # Execute
    new = (
        FedBN().aggregate_train(RoundInput(2, current, updates, {"site-1": 1, "site-2": 3}, MANIFEST)).weights
    )
    # Assert
    np.testing.assert_array_equal(new["fc.weight"], np.array([2.5, 0.5], np.float32))
    np.testing.assert_array_equal(new["bn.weight"], np.ones(1, np.float32))
    # Client 1's composed model: global shared tensors + its own NORM (bn.weight 1.2, running_mean 0.1)
    local_1 = {"bn.weight": np.array([1.2], np.float32), "bn.running_mean": np.array([0.1], np.float32)}
    composed = {**{n: new[n] for n in FedBN().shared_names(MANIFEST)}, **local_1}
    np.testing.assert_array_equal(composed["fc.weight"], [2.5, 0.5])
    assert composed["bn.weight"][0] == np.float32(1.2) and composed["bn.running_mean"][0] == np.float32(0.1)


def test_toy_shared_u_aggregated_local_g_kept() -> None:
    """Toy: u = 0.19, 0.95 -> 0.57; g = 1.19 and 0.81 stay on the sites."""
    # Prepare
    (u1, g1), (u2, g2) = _toy_local(1.0, 2.0), _toy_local(5.0, 0.0)
    assert (g1, g2) == pytest.approx((1.19, 0.81), abs=1e-12)
    manifest = {
        "u": TensorSpec("u", (1,), "float64", frozenset({"TRAIN"})),
        "g": _spec("g", "TRAIN", "NORM:BatchNorm1d"),
    }
    updates = [SiteUpdate("s1", {"u": np.array([u1])}, 5, 2), SiteUpdate("s2", {"u": np.array([u2])}, 5, 2)]
    # Execute
    rule = FedBN()
    new = rule.aggregate_train(
        RoundInput(1, {"u": np.zeros(1)}, updates, {"s1": 5, "s2": 5}, manifest)
    ).weights
    # Assert
    assert rule.shared_names(manifest) == ["u"]
    assert float(new["u"][0]) == pytest.approx(0.57, abs=1e-12)


def test_uniform_weighting_option() -> None:
    """weighting = uniform gives the original code's 1/N: [1,2],[3,0] with n=(1,3) -> [2,1]."""
    updates = [
        SiteUpdate("site-1", {"fc.weight": np.array([1.0, 2.0])}, 1, 2),
        SiteUpdate("site-2", {"fc.weight": np.array([3.0, 0.0])}, 3, 2),
    ]
    inp = RoundInput(1, {"fc.weight": np.zeros(2)}, updates, {"site-1": 1, "site-2": 3}, MANIFEST)
    np.testing.assert_allclose(
        FedBN({"weighting": "uniform"}).aggregate_train(inp).weights["fc.weight"], [2.0, 1.0]
    )


def test_bad_norm_type_is_a_config_error() -> None:
    """An unknown normalization family names fedbn and norm_types."""
    with pytest.raises(ConfigError, match="fedbn: norm_types"):
        FedBN({"norm_types": ["dropout"]})
