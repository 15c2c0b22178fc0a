"""Fixed-point encoding of secure aggregation (fedmqtt/secagg/ring.py): the stated error bounds hold, the ring
arithmetic sums exactly, and a configuration whose sum could wrap is refused when it is built."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedmqtt.errors import ConfigError
from fedmqtt.secagg.ring import FixedPoint

FLOATS = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)
RINGS = st.builds(FixedPoint, clip=st.sampled_from([0.5, 1.0, 3.0, 100.0]), fraction_bits=st.integers(0, 20),
                  bits=st.just(64), max_sites=st.integers(1, 300))


@settings(max_examples=100, deadline=None)
@given(fixed=RINGS, values=hnp.arrays(np.float32, st.integers(1, 40), elements=FLOATS))
def test_one_site_rounds_within_half_a_step(fixed: FixedPoint, values: np.ndarray) -> None:
    decoded = fixed.decode_sum(fixed.encode(values))
    clipped = np.clip(values.astype(np.float64), -fixed.clip, fixed.clip)
    assert np.all(np.abs(decoded - clipped) <= fixed.site_error_bound())


@settings(max_examples=100, deadline=None)
@given(bits=st.sampled_from([32, 64]), fraction_bits=st.integers(4, 16),
       updates=hnp.arrays(np.float32, st.tuples(st.integers(1, 40), st.integers(1, 8)),
                          elements=st.floats(-3.0, 3.0, width=32)))
def test_sum_of_n_sites_within_n_half_steps(bits: int, fraction_bits: int, updates: np.ndarray) -> None:
    n_sites, length = updates.shape
    fixed = FixedPoint(clip=2.0, fraction_bits=fraction_bits, bits=bits, max_sites=n_sites)
    total = fixed.zeros(length)
    for update in updates:
        total = total + fixed.encode(update)  # numpy's unsigned arithmetic is the ring's
    clear = np.sum([np.clip(u.astype(np.float64), -2.0, 2.0) for u in updates], axis=0)
    assert np.all(np.abs(fixed.decode_sum(total) - clear) <= fixed.sum_error_bound(n_sites))


def test_extremes_sum_to_the_edge_of_the_range_without_wrapping() -> None:
    fixed = FixedPoint(clip=1.0, fraction_bits=10, bits=32, max_sites=(2**31 - 1) // 1024)
    n = fixed.max_sites
    for sign in (1.0, -1.0):  # n equal encodings added in the ring: n times one (clipped to +-1)
        total = fixed.encode(np.full(3, sign * 5.0, dtype=np.float32)) * fixed.dtype(n)
        assert np.all(fixed.decode_sum(total) == sign * n)
    beyond = fixed.encode(np.full(3, 1.0, dtype=np.float32)) * fixed.dtype(2 * n)
    assert np.all(fixed.decode_sum(beyond) < 0)  # what the check at construction time prevents: a wrapped sum


def test_a_range_that_could_wrap_is_refused() -> None:
    FixedPoint(clip=1.0, fraction_bits=16, bits=32, max_sites=32767)  # 32767 * 65536 < 2^31
    with pytest.raises(ConfigError, match="bits=64"):
        FixedPoint(clip=1.0, fraction_bits=16, bits=32, max_sites=32768)
    with pytest.raises(ConfigError, match="beyond"):
        FixedPoint(clip=1.0, fraction_bits=52, bits=64, max_sites=3)  # past 2^53: float64 would round the sum


@pytest.mark.parametrize("bad", [dict(bits=16), dict(clip=0.0), dict(clip=float("nan")), dict(fraction_bits=-1),
                                 dict(max_sites=0)])
def test_bad_parameters_are_refused(bad: dict[str, float]) -> None:
    settings_ = {"clip": 1.0, "fraction_bits": 8, "bits": 32, "max_sites": 10, **bad}
    with pytest.raises(ConfigError):
        FixedPoint(**settings_)  # type: ignore[arg-type]


def test_non_finite_values_are_refused() -> None:
    fixed = FixedPoint(clip=1.0, fraction_bits=8)
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ValueError, match="finite"):
            fixed.encode(np.array([0.0, bad], dtype=np.float32))
