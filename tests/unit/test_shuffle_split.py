"""fedmqtt.data.shuffle_split draws the rows scikit-learn's train_test_split drew, so recorded splits stay."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.model_selection import train_test_split

from fedmqtt.data.shuffle_split import split_positions


def _reference(n: int, fraction: float, seed: int, strata: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
    try:
        kept, held = train_test_split(np.arange(n), test_size=fraction, random_state=seed, stratify=strata)
    except ValueError:
        return None
    return kept, held


@settings(max_examples=300, deadline=None)
@given(n=st.integers(3, 300), classes=st.integers(1, 6), stratified=st.booleans(),
       fraction=st.one_of(st.sampled_from([0.1, 0.2, 0.25, 1 / 3, 0.5]), st.floats(0.01, 0.99)),
       seed=st.integers(0, 2**32 - 1), data_seed=st.integers(0, 2**16))
def test_same_rows_in_the_same_order_as_scikit_learn(n: int, classes: int, stratified: bool, fraction: float,
                                                     seed: int, data_seed: int) -> None:
    labels = np.random.default_rng(data_seed).integers(0, classes, n)
    strata = labels if stratified else None
    expected = _reference(n, fraction, seed, strata)
    if expected is None:  # scikit-learn refuses (a class of one row, a side smaller than the classes...)
        with pytest.raises(ValueError):
            split_positions(n, fraction, seed, strata)
        return
    kept, held = split_positions(n, fraction, seed, strata)
    np.testing.assert_array_equal(kept, expected[0])
    np.testing.assert_array_equal(held, expected[1])


def test_ties_in_the_remainders_are_drawn_like_scikit_learn() -> None:
    """Three equal classes and a held-out size that leaves one row to place: the tie goes to a drawn class."""
    labels = np.repeat([0, 1, 2], 5)
    for seed in range(50):
        kept, held = split_positions(15, 0.25, seed, labels)
        ref_kept, ref_held = train_test_split(np.arange(15), test_size=0.25, random_state=seed, stratify=labels)
        np.testing.assert_array_equal(held, ref_held)
        np.testing.assert_array_equal(kept, ref_kept)


@pytest.mark.parametrize(("n", "fraction", "strata", "why"), [
    (10, 0.0, None, "fraction"), (10, 1.0, None, "fraction"), (3, 0.9, None, "none to keep"),
    (6, 0.5, np.array([0, 0, 0, 0, 0, 1]), "1 row"), (9, 0.2, np.repeat([0, 1, 2], 3), "fewer than the 3"),
])
def test_refusals_name_the_reason(n: int, fraction: float, strata: np.ndarray | None, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        split_positions(n, fraction, 0, strata)
