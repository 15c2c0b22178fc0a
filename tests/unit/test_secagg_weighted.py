"""FedAvg and FedProx from a secure sum (fedmqtt/secagg/weighted.py, fedmqtt/strategies/sums.py): a round of
masked weighted vectors, a site lost after its masked input (recovered), gives the same new global model as the
rule on the sites' own updates, within the stated bound; rules that need more than the mean are refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from secagg_round import Losses, play, site_ids

from fedmqtt.secagg import messages as msg
from fedmqtt.secagg.ring import FixedPoint
from fedmqtt.secagg.weighted import layout_of, mean_error_bound, mean_from_sum, site_weight, split, weighted_vector
from fedmqtt.strategies import build_strategy
from fedmqtt.strategies.base import RoundInput, SiteUpdate
from fedmqtt.strategies.sums import aggregate_from_mean

FIXED = FixedPoint(clip=4.0, fraction_bits=20, bits=64, max_sites=8)


def _model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"fc.weight": rng.normal(size=(3, 4)).astype(np.float32), "fc.bias": rng.normal(size=3).astype(np.float32),
            "bn.num_batches_tracked": np.array(5, dtype=np.int64)}


def _round(rule: str, n: int, *, lost_after_masked: set[str], seed: int = 1) -> tuple[dict, dict, float]:
    """(secure result, clear result on the included sites, bound): one round of `rule` both ways."""
    rng = np.random.default_rng(seed)
    current = _model(rng)
    names = site_ids(n)
    trained = {s: {k: (v + rng.normal(scale=0.3, size=np.shape(v)).astype(v.dtype) if v.dtype.kind == "f" else v + 3)
                   for k, v in current.items()} for s in names}
    counts = {s: int(rng.integers(20, 200)) for s in names}
    bound = float(sum(counts.values()))
    layout = layout_of(current)
    vectors = {s: weighted_vector(split(trained[s])[0], layout, counts[s], bound) for s in names}
    played = play(n, layout.length, fixed=FIXED, updates=vectors,
                  losses=Losses(before_answer=lost_after_masked))
    assert isinstance(played.outcome, msg.RoundSum), played.outcome
    included = played.outcome.included
    assert lost_after_masked <= set(included) and len(included) == n  # withholding an answer loses nothing
    mean, total_n = mean_from_sum(played.outcome.total, layout, bound)
    mean.update({k: np.max([trained[s][k] for s in included], axis=0) for k in split(current)[1]})
    inp = RoundInput(round_no=1, current=current, updates=[], enrolled=counts, manifest={})
    secure = aggregate_from_mean(build_strategy(rule, {}), inp, mean, total_n).weights
    clear_updates = [SiteUpdate(s, trained[s], counts[s], 1) for s in sorted(included)]
    clear = build_strategy(rule, {}).aggregate_train(
        RoundInput(round_no=1, current=current, updates=clear_updates, enrolled=counts, manifest={})).weights
    weight = sum(site_weight(counts[s], bound) for s in included)
    largest = max(float(np.max(np.abs(v))) for k, v in clear.items() if k in layout.names)
    # float32 tensors: the mean is cast back to float32, whose own rounding adds a relative 2^-24
    return secure, clear, mean_error_bound(FIXED, len(included), weight, largest) + largest * 2.0**-23


@pytest.mark.parametrize("rule", ["fedavg", "fedprox"])
def test_the_secure_mean_gives_the_rules_own_result_within_the_bound(rule: str) -> None:
    secure, clear, bound = _round(rule, 5, lost_after_masked=set())
    assert set(secure) == set(clear)
    for name in clear:
        assert secure[name].dtype == clear[name].dtype and secure[name].shape == clear[name].shape
        assert np.max(np.abs(secure[name].astype(np.float64) - clear[name])) <= bound, name
    assert bound < 1e-5


def test_a_site_lost_after_its_masked_input_is_recovered_and_counted() -> None:
    """site-002 sends its masked input and withholds its answer: the sum still unmasks (its seed is rebuilt from
    its neighbours' shares) and includes it, so the result equals the clear rule over all five sites."""
    secure, clear, bound = _round("fedavg", 5, lost_after_masked={"site-002"})
    for name in clear:
        assert np.max(np.abs(secure[name].astype(np.float64) - clear[name])) <= bound, name


def test_the_check_is_not_vacuous() -> None:
    """Dropping one site from the clear side moves the result far beyond the bound (the comparison can fail)."""
    secure, clear, bound = _round("fedavg", 5, lost_after_masked=set())
    moved = {k: v * 1.01 for k, v in clear.items() if v.dtype.kind == "f"}
    assert any(np.max(np.abs(secure[k].astype(np.float64) - moved[k])) > bound for k in moved)


def test_rules_that_need_more_than_the_mean_are_refused() -> None:
    inp = RoundInput(round_no=1, current={"w": np.zeros(2)}, updates=[], enrolled={}, manifest={})
    for rule in ("fednova", "fedadp"):
        with pytest.raises(ValueError, match="weighted mean"):
            aggregate_from_mean(build_strategy(rule, {}), inp, {"w": np.zeros(2)}, 10)


def test_a_layout_mismatch_and_a_zero_weight_are_refused() -> None:
    layout = layout_of({"a": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="layout"):
        weighted_vector({"a": np.zeros(3, np.float32)}, layout, 1, 10.0)
    with pytest.raises(ValueError, match="nothing to average"):
        mean_from_sum(np.zeros(3), layout, 10.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.floats(-3, 3)), min_size=1, max_size=8),
       st.floats(1.0, 1e5))
def test_weights_are_capped_at_one_and_the_mean_is_exact_without_rounding(sites: list[tuple[int, float]],
                                                                         bound: float) -> None:
    """Without the ring (plain float sums), mean_from_sum is the weighted mean of what the weights allow."""
    layout = layout_of({"a": np.zeros(2)})
    vectors = [weighted_vector({"a": np.full(2, value)}, layout, n, bound) for n, value in sites]
    assert all(0.0 <= v[-1] <= 1.0 for v in vectors)
    total = np.sum(vectors, axis=0)
    if total[-1] <= 0:
        return
    mean, _ = mean_from_sum(total, layout, bound)
    weights = np.array([site_weight(n, bound) for n, _ in sites])
    expected = float(np.dot(weights, [v for _, v in sites]) / weights.sum())
    assert np.allclose(mean["a"], expected, rtol=1e-9, atol=1e-12)
