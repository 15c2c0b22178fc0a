"""AdaFed, d-AdaFed, f-AdaFed servers (docs/algorithms.md 11.6): statistics, W, personal mixes, participation."""

from __future__ import annotations

import numpy as np
import pytest

from fedmqtt.errors import ConfigError
from fedmqtt.strategies import (
    AdaFed,
    FAdaFed,
    FeatureStatistics,
    RoundInput,
    SiteUpdate,
    TensorSpec,
    build_strategy,
)
from fedmqtt.strategies.adafed import distance_matrix, feature_statistics, similarity_matrix

SITES = ("c1", "c2", "c3")
# docs/algorithms.md 11.6: per client, layer -> (mean, var)
STATS = {
    "c1": {"bn1": (np.array([0.0, 0.0]), np.array([1.0, 1.0])), "bn2": (np.array([0.0]), np.array([1.0]))},
    "c2": {"bn1": (np.array([1.0, 0.0]), np.array([1.0, 1.0])), "bn2": (np.array([3.0]), np.array([1.0]))},
    "c3": {"bn1": (np.array([0.0, 0.0]), np.array([4.0, 1.0])), "bn2": (np.array([0.0]), np.array([1.0]))},
}
W_EXPECTED = [
    [0.5, 0.1, 0.4],
    [0.2623069601, 0.5, 0.2376930399],
    [0.4076504844, 0.0923495156, 0.5],
]
MANIFEST = {
    "psi": TensorSpec("psi", (1,), "float64", frozenset({"TRAIN"})),
    "bn1.weight": TensorSpec("bn1.weight", (2,), "float32", frozenset({"TRAIN", "NORM:BatchNorm2d"})),
    "bn1.running_var": TensorSpec(
        "bn1.running_var", (2,), "float32", frozenset({"FLOATBUF", "NORM:BatchNorm2d"})
    ),
    "gn.weight": TensorSpec("gn.weight", (2,), "float32", frozenset({"TRAIN", "NORM:GroupNorm"})),
    "steps": TensorSpec("steps", (), "int64", frozenset({"INTBUF"})),
}


def _input(values: dict[str, float], round_no: int = 1) -> RoundInput:
    """Scalar uploads psi_j* per participant, sorted by site id."""
    updates = [
        SiteUpdate(s, {"psi": np.array([v])}, 10 * (k + 1), 1)
        for k, (s, v) in enumerate(sorted(values.items()))
    ]
    return RoundInput(round_no, {"psi": np.zeros(1)}, updates, {s: 10 for s in SITES}, MANIFEST)


def _adafed(name: str = "adafed", **params: object) -> AdaFed:
    rule = build_strategy(name, {"lam": 0.5, **params})
    assert isinstance(rule, AdaFed)
    rule.set_statistics(STATS)
    return rule


def test_statistics_are_per_channel_mean_and_population_variance() -> None:
    """One channel holding 1, 2, 3, 6 has mean 3 and population variance 3.5 (also in an N,C,H,W layout)."""
    mean, var = feature_statistics(np.array([[1.0], [2.0], [3.0], [6.0]]))
    assert list(mean) == [3.0] and list(var) == [3.5]
    images = np.array([1.0, 2.0, 3.0, 6.0]).reshape(2, 1, 1, 2)  # N=2, C=1, H=1, W=2
    mean, var = feature_statistics(images)
    assert list(mean) == [3.0] and list(var) == [3.5]


def test_worked_example_distances_and_w() -> None:
    """d_12 = 4, d_13 = 1, d_23 = 4.4142135624; W as printed, rows summing to 1."""
    # Execute
    sites, d = distance_matrix(STATS)
    w = similarity_matrix(STATS, 0.5)
    # Assert
    assert sites == list(SITES)
    assert (d[0, 1], d[0, 2], d[1, 2]) == pytest.approx((4.0, 1.0, 4.4142135624), abs=1e-10)
    np.testing.assert_allclose(w, W_EXPECTED, rtol=0, atol=1e-10)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-15)


def test_worked_example_personalised_values() -> None:
    """psi* = (1, 2, 3) -> personal (1.9, 1.9753860798, 2.0923495156); weights = uniform mean 2."""
    # Prepare
    rule = _adafed()
    # Execute
    result = rule.aggregate_train(_input({"c1": 1.0, "c2": 2.0, "c3": 3.0}))
    # Assert
    got = [float(result.personal[s]["psi"][0]) for s in SITES]
    assert got == pytest.approx([1.9, 1.9753860798, 2.0923495156], abs=1e-10)
    assert float(result.weights["psi"][0]) == pytest.approx(2.0, abs=1e-15)
    assert rule.similarity is not None
    np.testing.assert_allclose(rule.similarity, W_EXPECTED, rtol=0, atol=1e-10)


def test_partial_participation_renormalises_over_participants() -> None:
    """Only clients 1 and 2: both get 0.5 own + 0.5 other = 1.5; client 3 gets nothing."""
    result = _adafed().aggregate_train(_input({"c1": 1.0, "c2": 2.0}))
    assert set(result.personal) == {"c1", "c2"}
    assert float(result.personal["c1"]["psi"][0]) == pytest.approx(1.5, abs=1e-12)
    assert float(result.personal["c2"]["psi"][0]) == pytest.approx(1.5, abs=1e-12)


def test_lone_participant_keeps_its_upload() -> None:
    """If i is the only participant its tensors come back unchanged."""
    result = _adafed().aggregate_train(_input({"c2": 2.5}))
    assert float(result.personal["c2"]["psi"][0]) == 2.5


def test_zero_distance_takes_all_of_one_minus_lambda() -> None:
    """Two sites with identical statistics: each gives the other 1 - lambda and the third site 0."""
    stats = {**STATS, "c2": STATS["c1"]}
    w = similarity_matrix(stats, 0.5)
    np.testing.assert_allclose(w[0], [0.5, 0.5, 0.0])
    np.testing.assert_allclose(w[1], [0.5, 0.5, 0.0])
    np.testing.assert_allclose(w[2].sum(), 1.0)


def test_batchnorm_local_everything_else_shared() -> None:
    """BN layers stay local (affine and buffers); GroupNorm and other buffers travel; `all` keeps GN local."""
    assert AdaFed().shared_names(MANIFEST) == ["gn.weight", "psi", "steps"]
    assert AdaFed({"norm_types": "all"}).shared_names(MANIFEST) == ["psi", "steps"]


def test_integer_buffers_take_the_maximum_in_every_personal_model() -> None:
    """A shared integer buffer is the maximum over participants, never mixed by W."""
    # Prepare
    updates = [
        SiteUpdate(s, {"psi": np.array([float(k)]), "steps": np.array(10 * (k + 1), np.int64)}, 5, 1)
        for k, s in enumerate(SITES)
    ]
    current = {"psi": np.zeros(1), "steps": np.array(0, np.int64)}
    # Execute
    result = _adafed().aggregate_train(RoundInput(1, current, updates, {s: 5 for s in SITES}, MANIFEST))
    # Assert
    for site in SITES:
        assert result.personal[site]["steps"].dtype == np.int64 and int(result.personal[site]["steps"]) == 30


def test_needs_statistics_until_they_are_set() -> None:
    """adafed and d-adafed need statistics before round 1; set_statistics clears that."""
    for name in ("adafed", "d-adafed"):
        rule = build_strategy(name)
        assert isinstance(rule, AdaFed) and rule.needs_statistics(1)
        rule.set_statistics(STATS)
        assert not rule.needs_statistics(1)


def test_f_adafed_runs_fedbn_during_the_warmup() -> None:
    """f-adafed: rounds 1..R_w are FedBN (p_i mean, no personal), statistics needed from round R_w + 1."""
    # Prepare
    rule = build_strategy("f-adafed", {"warmup_rounds": 2})
    assert isinstance(rule, FAdaFed)
    # Execute
    warm = rule.aggregate_train(_input({"c1": 1.0, "c2": 2.0, "c3": 3.0}, round_no=2))
    # Assert: n = (10, 20, 30)
    assert not warm.personal
    assert float(warm.weights["psi"][0]) == pytest.approx((10 * 1 + 20 * 2 + 30 * 3) / 60, abs=1e-12)
    assert not rule.needs_statistics(2) and rule.needs_statistics(3)
    rule.set_statistics(STATS)
    after = rule.aggregate_train(_input({"c1": 1.0, "c2": 2.0, "c3": 3.0}, round_no=3))
    assert float(after.personal["c1"]["psi"][0]) == pytest.approx(1.9, abs=1e-10)


def test_f_adafed_default_warmup_is_half_the_rounds() -> None:
    """R_w = floor(T / 2) by default."""
    assert FAdaFed({"total_rounds": 31}).warmup_rounds() == 15
    assert FAdaFed().warmup_rounds() == 10


def test_participant_without_statistics_gets_the_mean() -> None:
    """A site absent from W receives the uniform mean and is left out of the others' mixes."""
    # Prepare
    rule = _adafed()
    values = {"c1": 1.0, "c2": 2.0, "zz": 100.0}
    # Execute
    result = rule.aggregate_train(_input(values))
    # Assert
    assert float(result.personal["zz"]["psi"][0]) == pytest.approx(103.0 / 3, abs=1e-12)
    assert float(result.personal["c1"]["psi"][0]) == pytest.approx(1.5, abs=1e-12)


@pytest.mark.parametrize("value", [0.0, -0.5, 1.5])
def test_lambda_outside_zero_one_is_a_config_error(value: float) -> None:
    """lambda must be in (0, 1]; the message names the algorithm and the field."""
    with pytest.raises(ConfigError, match="adafed: lambda must be"):
        build_strategy("adafed", {"lambda": value})
    with pytest.raises(ConfigError, match="f-adafed: lam must be"):
        build_strategy("f-adafed", {"lam": value})


@pytest.mark.parametrize(("name", "params", "stats_round", "wanted"), [
    ("adafed", {}, 1, FeatureStatistics.BN_INPUTS),
    ("d-adafed", {}, 1, FeatureStatistics.PENULTIMATE),
    ("f-adafed", {"warmup_rounds": 3}, 3, FeatureStatistics.BN_RUNNING),
    ("f-adafed", {"warmup_rounds": 0}, 1, FeatureStatistics.BN_RUNNING),
    ("f-adafed", {"total_rounds": 9}, 4, FeatureStatistics.BN_RUNNING),
])
def test_sites_are_asked_for_their_statistics_once(name: str, params: dict, stats_round: int,
                                                    wanted: FeatureStatistics) -> None:
    """With the update of the last warm-up round (round 1 without one), and of no other round (11.1, 11.3)."""
    rule = build_strategy(name, params)
    asked = {r: rule.round_requirements(r).feature_stats for r in range(1, 12)}
    assert asked == {r: wanted if r == stats_round else None for r in range(1, 12)}
    assert float(asked[stats_round] or 0) == {"adafed": 1.0, "d-adafed": 2.0, "f-adafed": 3.0}[name]  # task code


def test_observed_statistics_fix_w_once() -> None:
    """The first non-empty statistics fix W; empty or later ones change nothing."""
    # Prepare
    rule = build_strategy("adafed", {"lam": 0.5})
    assert isinstance(rule, AdaFed)
    # Execute
    rule.observe_round(1, {})
    before = rule.similarity
    rule.observe_round(1, STATS)
    rule.observe_round(2, {s: STATS["c1"] for s in SITES})  # identical sites would give 0.25 everywhere
    # Assert
    assert before is None and rule.similarity is not None
    np.testing.assert_allclose(rule.similarity, W_EXPECTED, rtol=0, atol=1e-10)
