"""FedBN (and FedPxN, its server) and the FedOpt family (FedAdam, FedAdagrad, FedYogi) from a secure sum: their
server step reads the updates only through the sample-weighted mean (fedmqtt/strategies/sums.py), so a round of
masked weighted vectors gives the rule's own in-the-clear result within the ring's stated bound; with
`weighting = "uniform"` (a plain mean the ring does not carry) they are refused, by the rule and at config load."""

from __future__ import annotations

import numpy as np
import pytest
from secagg_round import play, site_ids

from fedmqtt.secagg import messages as msg
from fedmqtt.secagg.ring import FixedPoint
from fedmqtt.secagg.weighted import (
    layout_of,
    mean_error_bound,
    mean_from_sum,
    normalised_from_sum,
    site_weight,
    split,
    variates_from_sum,
    weighted_vector,
)
from fedmqtt.strategies import build_strategy
from fedmqtt.strategies.base import Manifest, RoundInput, SiteUpdate, TensorSpec, Weights
from fedmqtt.strategies.sums import (
    NormalisedSums,
    aggregate_from_mean,
    aggregate_from_sums,
    aggregate_from_uniform_mean,
)
from ps_daemon.config import SecureAggregationConfig, secure_aggregation_problem

FIXED = FixedPoint(clip=4.0, fraction_bits=20, bits=64, max_sites=8)
TRAIN = frozenset({"TRAIN"})
BN = frozenset({"TRAIN", "NORM:BatchNorm2d"})
BN_STAT = frozenset({"NORM:BatchNorm2d"})


def _model(rng: np.random.Generator) -> tuple[Weights, Manifest]:
    model = {"fc.weight": rng.normal(size=(3, 4)).astype(np.float32), "fc.bias": rng.normal(size=3).astype(np.float32),
             "bn.weight": rng.normal(size=3).astype(np.float32), "bn.running_mean": np.zeros(3, np.float32),
             "bn.num_batches_tracked": np.array(5, dtype=np.int64)}
    tags = {"fc.weight": TRAIN, "fc.bias": TRAIN, "bn.weight": BN, "bn.running_mean": BN_STAT,
            "bn.num_batches_tracked": BN_STAT}
    return model, {n: TensorSpec(n, tuple(np.shape(v)), str(v.dtype), tags[n]) for n, v in model.items()}


def _both_ways(rule: str, params: dict[str, object], n: int = 5, seed: int = 3) -> tuple[Weights, Weights, float]:
    """(secure result, clear result, the bound on |mean error|) of one round of `rule`: the sites mask only the
    float tensors the rule shares, as the site agent does."""
    rng = np.random.default_rng(seed)
    current, manifest = _model(rng)
    strategy = build_strategy(rule, params)
    shared = {k: current[k] for k in strategy.shared_names(manifest)}
    names = site_ids(n)
    trained = {s: {k: (v + rng.normal(scale=0.3, size=np.shape(v)).astype(v.dtype) if v.dtype.kind == "f" else v + 3)
                   for k, v in current.items()} for s in names}
    counts = {s: int(rng.integers(20, 200)) for s in names}
    bound = float(sum(counts.values()))
    layout = layout_of(split(shared)[0])
    vectors = {s: weighted_vector({k: trained[s][k] for k in layout.names}, layout, counts[s], bound) for s in names}
    played = play(n, layout.length, fixed=FIXED, updates=vectors)
    assert isinstance(played.outcome, msg.RoundSum), played.outcome
    mean, total_n = mean_from_sum(played.outcome.total, layout, bound)
    mean.update(split(shared)[1])  # integer buffers keep the server's value (as the PS does)
    inp = RoundInput(round_no=1, current=current, updates=[], enrolled=counts, manifest=manifest)
    secure = aggregate_from_mean(strategy, inp, mean, total_n).weights
    clear_updates = [SiteUpdate(s, {k: trained[s][k] for k in shared}, counts[s], 1) for s in names]
    clear = build_strategy(rule, params).aggregate_train(
        RoundInput(round_no=1, current=current, updates=clear_updates, enrolled=counts, manifest=manifest)).weights
    weight = sum(site_weight(counts[s], bound) for s in names)
    largest = max(float(np.max(np.abs(trained[s][k]))) for s in names for k in layout.names)
    # + the float32 cast of the mean (relative 2^-24, twice for safety)
    return secure, clear, mean_error_bound(FIXED, n, weight, largest) + largest * 2.0**-23


def test_fedbn_gives_its_own_result_and_never_touches_the_local_layers() -> None:
    for rule in ("fedbn", "fedpxn"):
        secure, clear, bound = _both_ways(rule, {})
        assert set(secure) == set(clear) and bound < 1e-4
        for name in ("fc.weight", "fc.bias"):
            assert np.max(np.abs(secure[name].astype(np.float64) - clear[name])) <= bound, (rule, name)
        for name in ("bn.weight", "bn.running_mean", "bn.num_batches_tracked"):  # local: the server's own copy
            assert np.array_equal(secure[name], clear[name]), (rule, name)


@pytest.mark.parametrize("rule", ["fedadam", "fedadagrad", "fedyogi"])
def test_the_fedopt_family_gives_its_own_step_within_the_bound(rule: str) -> None:
    """In round 1 the server step eta_g m / (sqrt(v) + tau) moves by at most eta_g (1 - b1) / tau times the change
    of the mean delta (FedAdam and FedAdagrad everywhere; FedYogi away from |Delta| = tau, where its
    sign(v - Delta^2) switches: a coordinate that close would take the other branch and fail this test)."""
    eta_g, tau, b1 = 0.01, 1e-3, 0.9
    secure, clear, bound = _both_ways(rule, {"eta_g": eta_g, "tau": tau, "b1": b1})
    lipschitz = eta_g * (1 - b1) / tau
    for name in clear:
        got, want = secure[name].astype(np.float64), clear[name].astype(np.float64)
        assert secure[name].dtype == clear[name].dtype, name
        if name == "bn.num_batches_tracked":  # an integer buffer: the server's value (a sum gives no maximum)
            continue
        # float32 results: their own rounding (relative 2^-24 of each) on top
        slack = lipschitz * bound + (np.max(np.abs(want)) + 1.0) * 2.0**-23
        assert np.max(np.abs(got - want)) <= slack, name
    assert lipschitz * bound < 1e-4


def test_the_fedopt_check_is_not_vacuous() -> None:
    """A pseudo-gradient off by 1 % moves FedAdam's result beyond the allowance: the comparison can fail."""
    secure, clear, bound = _both_ways("fedadam", {})
    assert any(np.max(np.abs(secure[k].astype(np.float64) - clear[k] * 1.01)) > bound for k in ("fc.weight", "fc.bias"))


@pytest.mark.parametrize("rule", ["fedbn", "fedpxn", "fedadam", "fedadagrad", "fedyogi", "scaffold"])
def test_uniform_weighting_is_refused_by_the_rule_and_at_config_load(rule: str) -> None:
    inp = RoundInput(round_no=1, current={"w": np.zeros(2)}, updates=[], enrolled={}, manifest={})
    with pytest.raises(ValueError, match="uniform"):
        aggregate_from_mean(build_strategy(rule, {"weighting": "uniform"}), inp, {"w": np.zeros(2)}, 10)
    on = SecureAggregationConfig(enabled=True)
    assert secure_aggregation_problem(rule, on, 4) is None
    problem = secure_aggregation_problem(rule, on, 4, {"weighting": "uniform"})
    assert problem is not None and "uniform" in problem


def test_scaffold_moves_the_model_and_its_control_variate_as_in_the_clear() -> None:
    """SCAFFOLD under partial participation (a sixth enrolled site not selected): each site masks p_i delta_c_i
    after its weighted model; the PS's model step and new c equal the rule's own on the sites' updates within the
    ring's bound (c's coordinates: B / n times the sum's rounding error, plus float32's own)."""
    # Prepare
    rng = np.random.default_rng(11)
    current, manifest = _model(rng)
    n, names = 5, site_ids(5)
    shared = {k: current[k] for k in build_strategy("scaffold", {}).shared_names(manifest)}
    layout = layout_of(split(shared)[0], variates=True)
    train = [k for k in layout.names if "TRAIN" in manifest[k].tags]
    trained = {s: {k: (v + rng.normal(scale=0.3, size=np.shape(v)).astype(v.dtype) if v.dtype.kind == "f" else v + 3)
                   for k, v in current.items()} for s in names}
    delta_c = {s: {k: rng.normal(scale=0.5, size=np.shape(current[k])).astype(np.float32) for k in train}
               for s in names}
    counts = {s: int(rng.integers(20, 200)) for s in names}
    enrolled = {**counts, "site-absent": 300}  # enrolled, not selected: c moves by n_i / n over all of them
    bound = float(sum(counts.values()))
    vectors = {s: weighted_vector({k: trained[s][k] for k in layout.names}, layout, counts[s], bound, delta_c[s])
               for s in names}
    # Execute
    played = play(n, layout.length, fixed=FIXED, updates=vectors)
    assert isinstance(played.outcome, msg.RoundSum), played.outcome
    mean, total_n = mean_from_sum(played.outcome.total, layout, bound)
    mean.update(split(shared)[1])
    sums = variates_from_sum(played.outcome.total, layout, bound)
    secure_rule = build_strategy("scaffold", {})
    inp = RoundInput(round_no=1, current=current, updates=[], enrolled=enrolled, manifest=manifest)
    secure = aggregate_from_mean(secure_rule, inp, mean, total_n, sums, played.outcome.included)
    clear_rule = build_strategy("scaffold", {})
    clear = clear_rule.aggregate_train(RoundInput(round_no=1, current=current, enrolled=enrolled, manifest=manifest,
                                                  updates=[SiteUpdate(s, {k: trained[s][k] for k in shared},
                                                                      counts[s], 1, extras={"delta_c": delta_c[s]})
                                                           for s in names]))
    # Assert
    weight = sum(site_weight(counts[s], bound) for s in names)
    largest = max(float(np.max(np.abs(trained[s][k]))) for s in names for k in layout.names)
    model_bound = mean_error_bound(FIXED, n, weight, largest) + largest * 2.0**-23
    for name in ("fc.weight", "fc.bias", "bn.weight", "bn.running_mean"):
        assert np.max(np.abs(secure.weights[name].astype(np.float64) - clear.weights[name])) <= model_bound, name
    c_bound = bound / sum(enrolled.values()) * FIXED.sum_error_bound(n)
    for name in train:
        got, want = secure_rule.c[name], clear_rule.c[name]
        assert 0 < np.max(np.abs(want)) and np.max(np.abs(got - want)) <= c_bound, name
        assert np.max(np.abs(secure.extras["c"][name].astype(np.float64) - want)) <= c_bound + np.max(
            np.abs(want)) * 2.0**-23, name
    # Not vacuous: without the absent site's count, c would move n / n_S times as far
    assert any(np.max(np.abs(secure_rule.c[k] * sum(enrolled.values()) / bound - clear_rule.c[k])) > c_bound
               for k in train)


def test_scaffold_without_the_variates_sum_is_refused() -> None:
    inp = RoundInput(round_no=1, current={"w": np.zeros(2)}, updates=[], enrolled={}, manifest={})
    with pytest.raises(ValueError, match="control-variate"):
        aggregate_from_mean(build_strategy("scaffold", {}), inp, {"w": np.zeros(2)}, 10)
    with pytest.raises(ValueError, match="control-variate delta"):
        weighted_vector({"w": np.zeros(2, np.float32)}, layout_of({"w": np.zeros(2, np.float32)}, variates=True),
                        1, 10.0, {"w": np.array([np.nan, 0.0])})


@pytest.mark.parametrize("tau_eff", ["norm", "steps"])
def test_fednova_steps_from_its_sums_as_in_the_clear(tau_eff: str) -> None:
    """FedNova: each site masks p_i y_i, p_i, p_i y_i / a_i, p_i a_i / W, p_i tau_i / W and p_i / a_i; the PS's
    step x - eta_g tau_eff (x S - T) / P equals the rule's own on the sites' updates (one site took no step:
    a_i = 0, it adds to the weights only) within the bound that the sums' rounding gives."""
    # Prepare
    rng = np.random.default_rng(7)
    current, manifest = _model(rng)
    n, names = 5, site_ids(5)
    strategy = build_strategy("fednova", {"tau_eff": tau_eff})
    shared = {k: current[k] for k in strategy.shared_names(manifest)}
    layout = layout_of(split(shared)[0], normalised=True)
    trained = {s: {k: (v + rng.normal(scale=0.3, size=np.shape(v)).astype(v.dtype) if v.dtype.kind == "f" else v + 3)
                   for k, v in current.items()} for s in names}
    counts = {s: int(rng.integers(20, 200)) for s in names}
    steps = dict(zip(names, (5, 12, 30, 0, 8), strict=True))
    a_norm = {s: 0.0 if steps[s] == 0 else steps[s] * 1.7 for s in names}  # as heavy-ball momentum would give
    bound, work_bound = float(sum(counts.values())), 60.0
    vectors = {s: weighted_vector({k: trained[s][k] for k in layout.names}, layout, counts[s], bound,
                                  work=(a_norm[s], steps[s], work_bound)) for s in names}
    # Execute
    played = play(n, layout.length, fixed=FIXED, updates=vectors)
    assert isinstance(played.outcome, msg.RoundSum), played.outcome
    mean, _ = mean_from_sum(played.outcome.total, layout, bound)
    mean.update(split(shared)[1])
    sums = NormalisedSums(*normalised_from_sum(played.outcome.total, layout, work_bound))
    inp = RoundInput(round_no=1, current=current, updates=[], enrolled=counts, manifest=manifest)
    secure = aggregate_from_sums(strategy, inp, mean, sums).weights
    clear = build_strategy("fednova", {"tau_eff": tau_eff}).aggregate_train(RoundInput(
        round_no=1, current=current, enrolled=counts, manifest=manifest,
        updates=[SiteUpdate(s, {k: trained[s][k] for k in shared}, counts[s], steps[s],
                            extras={"a_norm": a_norm[s]}) for s in names])).weights
    # Assert: d = (x S - T) / P and tau_eff = A / P, each sum off by at most e (A and the steps by W e)
    e = FIXED.sum_error_bound(n)
    p_total = sum(site_weight(counts[s], bound) for s in names)
    work = [a_norm[s] if tau_eff == "norm" else steps[s] for s in names]
    tau = sum(site_weight(counts[s], bound) * w for s, w in zip(names, work, strict=True)) / p_total
    for name in ("fc.weight", "fc.bias", "bn.weight"):  # TRAIN tensors
        x = np.abs(current[name].astype(np.float64))
        d = np.abs(current[name].astype(np.float64) - clear[name]) / tau  # |d| of the clear step (eta_g = 1)
        d_err = (x * e + e + d * e) / (p_total - e)
        tau_err = (work_bound * e + tau * e) / (p_total - e)
        allowed = tau * d_err + d * tau_err + d_err * tau_err + (np.abs(clear[name]) + 1.0) * 2.0**-23
        diff = np.abs(secure[name].astype(np.float64) - clear[name])
        assert (diff <= allowed).all(), (name, float(np.max(diff - allowed)))
        assert float(np.max(d * tau)) > 1000 * float(np.max(allowed))  # the step is far larger: this can fail
    largest = max(float(np.max(np.abs(trained[s]["bn.running_mean"]))) for s in names)
    buffer_bound = mean_error_bound(FIXED, n, p_total, largest) + largest * 2.0**-23
    diff = np.abs(secure["bn.running_mean"].astype(np.float64) - clear["bn.running_mean"])
    assert float(np.max(diff)) <= buffer_bound  # a float buffer: the weighted mean
    assert np.array_equal(secure["bn.num_batches_tracked"], current["bn.num_batches_tracked"])  # the server's


def test_fednova_work_beyond_the_bound_is_refused_not_clipped() -> None:
    layout = layout_of({"w": np.zeros(2, np.float32)}, normalised=True)
    with pytest.raises(ValueError, match="exceeds the round's bound"):
        weighted_vector({"w": np.ones(2, np.float32)}, layout, 10, 100.0, work=(61.0, 30, 60.0))
    with pytest.raises(ValueError, match="below 1"):
        weighted_vector({"w": np.ones(2, np.float32)}, layout, 10, 100.0, work=(0.5, 1, 60.0))
    with pytest.raises(ValueError, match="local work"):
        weighted_vector({"w": np.ones(2, np.float32)}, layout, 10, 100.0)


def _plain_mean_round(rule: str, params: dict[str, object], n: int = 5, seed: int = 4, enrolled_extra: int = 2,
                      rounds: int = 2) -> tuple[list[tuple[Weights, Weights]], object, object, float, int]:
    """`rounds` rounds of a plain-mean rule, secure and clear side by side on the same sites: the sites weigh their
    masked vectors by 1 (p_i = 1 / B, B = n selected sites), as the terms' `uniform` tells them. Returns per round
    (secure weights, clear weights), both strategies (their state), the bound on |mean error| and the count the PS
    read from the sum. `enrolled_extra` sites are enrolled but not selected (FedDyn's N counts them)."""
    rng = np.random.default_rng(seed)
    current, manifest = _model(rng)
    secure_rule, clear_rule = build_strategy(rule, params), build_strategy(rule, params)
    names = site_ids(n)
    counts = {s: int(rng.integers(20, 200)) for s in names}
    enrolled = {**counts, **{f"idle-{i}": 50 for i in range(enrolled_extra)}}
    bound_b = float(n)  # B for the plain mean: the number of selected sites
    shared = {k: current[k] for k in secure_rule.shared_names(manifest)}
    layout = layout_of(split(shared)[0])
    out: list[tuple[Weights, Weights]] = []
    secure_now, clear_now = dict(current), dict(current)
    largest, count = 0.0, 0
    for r in range(1, rounds + 1):
        trained = {s: {k: (v + rng.normal(scale=0.3, size=np.shape(v)).astype(v.dtype) if v.dtype.kind == "f"
                           else v + 3) for k, v in current.items()} for s in names}
        vectors = {s: weighted_vector({k: trained[s][k] for k in layout.names}, layout, 1, bound_b) for s in names}
        played = play(n, layout.length, fixed=FIXED, updates=vectors, round_no=r)
        assert isinstance(played.outcome, msg.RoundSum), played.outcome
        mean, count = mean_from_sum(played.outcome.total, layout, bound_b)
        mean.update(split({k: secure_now[k] for k in shared})[1])
        secure = aggregate_from_uniform_mean(secure_rule, RoundInput(r, {k: secure_now[k] for k in shared}, [],
                                                                     enrolled, manifest), mean, count)
        clear = clear_rule.aggregate_train(RoundInput(r, {k: clear_now[k] for k in shared}, [
            SiteUpdate(s, {k: trained[s][k] for k in shared}, counts[s], 1) for s in names], enrolled, manifest))
        out.append((secure.weights, clear.weights))
        secure_now.update(secure.weights)
        clear_now.update(clear.weights)
        largest = max(largest, *(float(np.max(np.abs(trained[s][k]))) for s in names for k in layout.names))
    # the mean's bound with P = n / B = 1, plus the float32 cast of the mean (relative 2^-24, twice for safety)
    return out, secure_rule, clear_rule, mean_error_bound(FIXED, n, 1.0, largest) + largest * 2.0**-23, count


def test_feddyn_from_the_plain_mean_moves_theta_and_its_drift_as_in_the_clear() -> None:
    """FedDyn's theta_avg is the plain mean and S_bar moves by the sum of the changes over N (enrolled, not only
    selected); both within the bound, over two rounds (the drift carries into the second)."""
    rounds, secure_rule, clear_rule, bound, count = _plain_mean_round("feddyn", {})
    assert count == 5 and bound < 1e-4
    n_enrolled = 7
    for secure, clear in rounds:
        for name in ("fc.weight", "fc.bias"):  # theta_send = theta_avg + S_bar: S_bar's error is count / N of it
            error = np.max(np.abs(secure[name].astype(np.float64) - clear[name].astype(np.float64)))
            assert error <= 2 * bound * (1 + 2 * count / n_enrolled), name
    for name in ("fc.weight", "fc.bias"):
        s_bar_error = np.max(np.abs(secure_rule.s_bar[name] - clear_rule.s_bar[name]))
        assert s_bar_error <= 2 * count / n_enrolled * bound, name
        assert np.max(np.abs(clear_rule.s_bar[name])) > 100 * bound  # the comparison can fail
        assert np.max(np.abs(secure_rule.theta_avg[name].astype(np.float64) - clear_rule.theta_avg[name])) <= bound


def test_fedfbn_from_the_plain_mean_is_its_uniform_mean() -> None:
    """FedFBN (masked_loss) from the plain mean equals its own uniform mean within the bound."""
    rounds, _, _, bound, _ = _plain_mean_round("fedfbn", {"partial_labels": "masked_loss"}, rounds=1)
    secure, clear = rounds[0]
    assert set(secure) == set(clear)
    for name in ("fc.weight", "fc.bias"):
        assert np.max(np.abs(secure[name].astype(np.float64) - clear[name].astype(np.float64))) <= bound, name


def test_a_weighted_rule_is_refused_the_plain_mean() -> None:
    """Surgical FedFBN is accepted (its output rows come from per-label sums, test_secagg_surgical.py)."""
    sa = SecureAggregationConfig(enabled=True)
    assert secure_aggregation_problem("fedfbn", sa, 5) is None  # the default: surgical
    assert secure_aggregation_problem("fedfbn", sa, 5, {"partial_labels": "masked_loss"}) is None
    assert secure_aggregation_problem("feddyn", sa, 5) is None
    inp = RoundInput(1, {}, [], {}, {})
    with pytest.raises(ValueError, match="plain mean"):
        aggregate_from_uniform_mean(build_strategy("fedavg", {}), inp, {}, 3)


def test_base_from_the_plain_mean_of_no_tensor_keeps_the_model() -> None:
    """Base shares nothing: its masked vector is the weight alone, the PS reads how many sites trained, and the
    model stays what it was."""
    rng = np.random.default_rng(6)
    current, manifest = _model(rng)
    rule = build_strategy("base", {})
    layout = layout_of(split({k: current[k] for k in rule.shared_names(manifest)})[0])
    assert layout.length == 1
    played = play(4, 1, fixed=FIXED, updates={s: weighted_vector({}, layout, 1, 4.0) for s in site_ids(4)})
    assert isinstance(played.outcome, msg.RoundSum)
    mean, count = mean_from_sum(played.outcome.total, layout, 4.0)
    assert (mean, count) == ({}, 4)
    out = aggregate_from_uniform_mean(rule, RoundInput(1, current, [], {}, manifest), mean, count).weights
    assert all(np.array_equal(out[k], current[k]) for k in current)
