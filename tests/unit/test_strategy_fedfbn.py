"""FedFBN (docs/algorithms.md section 14): BN never sent, uniform mean, surgical aggregation of the output."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# The worked example on the union output layer (row r = label r, every site carries all three rows): A annotates
# rows 0 and 1, B rows 1 and 2; the row a site does not annotate holds whatever its training left there.
UNION_MANIFEST = {
    "conv.weight": MANIFEST["conv.weight"],
    "fc.weight": TensorSpec("fc.weight", (3, 2), "float32", frozenset({"TRAIN", "HEAD"})),
    "fc.bias": TensorSpec("fc.bias", (3,), "float32", frozenset({"TRAIN", "HEAD"})),
}
UNION_A = {"conv.weight": [1.0, 2.0], "fc.weight": [[1.0, 1.0], [2.0, 2.0], [9.0, 9.0]], "fc.bias": [0.1, 0.2, 0.9]}
UNION_B = {"conv.weight": [3.0, 0.0], "fc.weight": [[7.0, 7.0], [4.0, 0.0], [5.0, 5.0]], "fc.bias": [0.7, 0.4, 0.5]}


def _union_round(label_sets: dict[str, tuple[int, ...] | None], rule: FedFBN | None = None) -> dict[str, np.ndarray]:
    updates = [SiteUpdate(site, {k: np.array(v, np.float32) for k, v in arrays.items()}, n, 1,
                          extras={} if label_sets[site] is None else {"label_set": label_sets[site]})
               for site, arrays, n in (("A", UNION_A, 1), ("B", UNION_B, 7)) if site in label_sets]
    current = {"conv.weight": np.zeros(2, np.float32), "fc.weight": np.full((3, 2), -1.0, np.float32),
               "fc.bias": np.full(3, -1.0, np.float32)}
    result = (rule or FedFBN()).aggregate_train(RoundInput(1, current, updates, {"A": 1, "B": 7}, UNION_MANIFEST))
    assert not result.personal  # every site takes its rows from the shared union layer
    return result.weights


def test_surgical_rows_average_over_the_sites_that_annotate_each_label() -> None:
    """Row 0 (only A annotates it) is A's row, row 2 (only B) is B's, row 1 the mean of both; the body is the
    uniform mean. The plain mean would give [4, 4], [3, 1], [7, 7]."""
    # Execute
    rule = FedFBN()
    weights = _union_round({"A": (0, 1), "B": (1, 2)}, rule)
    # Assert
    np.testing.assert_array_equal(weights["conv.weight"], np.array([2.0, 1.0], np.float32))
    np.testing.assert_array_equal(weights["fc.weight"][0], np.array(UNION_A["fc.weight"][0], np.float32))
    np.testing.assert_array_equal(weights["fc.weight"][2], np.array(UNION_B["fc.weight"][2], np.float32))
    np.testing.assert_allclose(weights["fc.weight"][1], [3.0, 1.0])
    np.testing.assert_allclose(weights["fc.bias"], [0.1, 0.3, 0.5], atol=1e-7)
    assert weights["fc.bias"].dtype == np.float32
    assert sorted(rule.state_dict()["label_rows"]) == ["0", "1", "2"]


def test_a_label_nobody_annotates_keeps_its_current_rows() -> None:
    weights = _union_round({"A": (0,), "B": ()})
    np.testing.assert_array_equal(weights["fc.weight"][0], np.array([1.0, 1.0], np.float32))
    np.testing.assert_array_equal(weights["fc.weight"][1:], np.full((2, 2), -1.0, np.float32))
    np.testing.assert_array_equal(weights["fc.bias"][1:], np.full(2, -1.0, np.float32))


def test_a_surgical_round_without_a_label_set_is_refused_not_averaged() -> None:
    """A site that names no label set would silently turn surgical into masked_loss: the rule refuses instead."""
    with pytest.raises(ValueError, match=r"surgical.*\['B'\] name no label set"):
        _union_round({"A": (0, 1), "B": None})
    with pytest.raises(ValueError, match="not increasing row indices"):
        _union_round({"A": (0, 3), "B": (1,)})
    with pytest.raises(ValueError, match="not increasing row indices"):
        _union_round({"A": (1, 0), "B": (1,)})


def test_masked_loss_needs_no_label_set() -> None:
    weights = _union_round({"A": None, "B": None}, FedFBN({"partial_labels": "masked_loss"}))
    np.testing.assert_allclose(weights["fc.weight"], [[4.0, 4.0], [3.0, 1.0], [7.0, 7.0]])


@settings(max_examples=60, deadline=None)
@given(masks=st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=1, max_size=5),
       seed=st.integers(0, 2**16))
def test_each_row_is_the_mean_over_its_labels_holders(masks: list[list[bool]], seed: int) -> None:
    """Any masks: row r is the mean of row r over the sites whose label set holds r (in float64, cast once),
    a row nobody annotates is untouched, and the body is the uniform mean of every site."""
    rng = np.random.default_rng(seed)
    manifest = {"body": TensorSpec("body", (3,), "float32", frozenset({"TRAIN"})),
                "out.weight": TensorSpec("out.weight", (4, 3), "float32", frozenset({"TRAIN", "HEAD"}))}
    current = {"body": rng.normal(size=3).astype(np.float32), "out.weight": rng.normal(size=(4, 3)).astype(np.float32)}
    sites = [f"s{i}" for i in range(len(masks))]
    tensors = {s: {k: rng.normal(size=v.shape).astype(np.float32) for k, v in current.items()} for s in sites}
    sets = {s: tuple(int(r) for r in np.flatnonzero(m)) for s, m in zip(sites, masks, strict=True)}
    updates = [SiteUpdate(s, tensors[s], 3, 1, extras={"label_set": sets[s]}) for s in sites]
    got = FedFBN().aggregate_train(RoundInput(1, current, updates, dict.fromkeys(sites, 3), manifest)).weights
    np.testing.assert_allclose(got["body"], np.mean([tensors[s]["body"] for s in sites], axis=0), atol=1e-6)
    for r in range(4):
        holders = [s for s in sites if r in sets[s]]
        if not holders:
            np.testing.assert_array_equal(got["out.weight"][r], current["out.weight"][r])
        else:
            want = np.mean([tensors[s]["out.weight"][r].astype(np.float64) for s in holders], axis=0)
            np.testing.assert_allclose(got["out.weight"][r], want, atol=1e-6)


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
