"""DP-FedAvg (fedmqtt/strategies/dp_fedavg.py, docs/algorithms.md 21): the clipping bound, the fixed denominator,
the noise's scale measured, adaptive clipping reaching its quantile, and the accountant against Opacus."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from fedmqtt.errors import ConfigError
from fedmqtt.strategies.base import RoundInput, SiteUpdate, TensorSpec
from fedmqtt.strategies.dp_fedavg import DPFedAvg
from fedmqtt.strategies.registry import build_strategy

pytest.importorskip("opacus")


def _spec(name: str, shape: tuple[int, ...], *tags: str, dtype: str = "float32") -> TensorSpec:
    return TensorSpec(name, shape, dtype, frozenset(tags))


MANIFEST = {"w": _spec("w", (2,), "TRAIN"), "run_var": _spec("run_var", (1,), "FLOATBUF"),
            "count": _spec("count", (), "INTBUF", dtype="int64")}


def _rule(**params: float) -> DPFedAvg:
    rule = build_strategy("dp-fedavg", {"noise_seed": 3, **params})
    assert isinstance(rule, DPFedAvg)
    return rule


def _round(rule: DPFedAvg, changes: dict[str, list[float]], *, enrolled: int | None = None, round_no: int = 1,
           manifest: dict[str, TensorSpec] | None = None) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Sites with the given changes of "w" (run_var and count moved too) from w = 0; the new weights and diagnostics."""
    current = {"w": np.zeros(2, np.float32), "run_var": np.ones(1, np.float32), "count": np.array(5, np.int64)}
    updates = [SiteUpdate(s, {"w": np.asarray(d, np.float32), "run_var": np.ones(1, np.float32),
                              "count": np.array(99, np.int64)}, 10, 1) for s, d in sorted(changes.items())]
    names = {s: 10 for s in changes}
    names |= {f"other{k}": 10 for k in range((enrolled or len(changes)) - len(changes))}  # enrolled, not answering
    result = rule.aggregate_train(RoundInput(round_no, current, updates, names, manifest or MANIFEST))
    return dict(result.weights), dict(result.diagnostics)


def test_worked_example_clips_and_divides_by_the_fixed_denominator() -> None:
    """docs/algorithms.md 21's example: [3, 4] is clipped to [0.6, 0.8], [0.3, 0] is kept."""
    w, diag = _round(_rule(noise_multiplier=0.0, sites_per_round=2), {"a": [3, 4], "b": [0.3, 0]})
    np.testing.assert_allclose(w["w"], [0.45, 0.4], rtol=1e-6)
    w, _ = _round(_rule(noise_multiplier=0.0, sites_per_round=2), {"b": [0.3, 0]})
    np.testing.assert_allclose(w["w"], [0.15, 0.0], rtol=1e-6)  # one answered: still / 2
    assert diag["clip_norm"] == 1.0 and "epsilon" not in diag  # no noise: no finite epsilon to report


def test_each_site_moves_the_model_by_at_most_c_over_m() -> None:
    """Sensitivity: adding or removing one site, however large its change, moves the noiseless mean by <= C / m."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        changes = {f"s{k}": list(rng.normal(0, 10, 2)) for k in range(4)}
        rule = _rule(noise_multiplier=0.0, clip_norm=0.5, sites_per_round=4)
        with_all, _ = _round(rule, changes)
        without, _ = _round(_rule(noise_multiplier=0.0, clip_norm=0.5, sites_per_round=4),
                            {k: v for k, v in changes.items() if k != "s0"}, enrolled=4)
        moved = math.sqrt(float(np.sum((with_all["w"] - without["w"]) ** 2) + np.sum(
            (with_all["run_var"] - without["run_var"]) ** 2)))
        assert moved <= 0.5 / 4 * (1 + 1e-5)


def test_integer_buffers_keep_the_servers_value() -> None:
    w, _ = _round(_rule(), {"a": [0.1, 0.1]})
    assert int(w["count"]) == 5 and w["count"].dtype == np.int64


def test_noise_has_std_z_c_over_m() -> None:
    """One site with no change and a model of 20,000 weights: every weight moves by N(0, (z C / m)^2) alone."""
    manifest = {"w": _spec("w", (20_000,), "TRAIN")}
    rule = build_strategy("dp-fedavg", {"noise_seed": 11, "noise_multiplier": 1.5, "clip_norm": 0.4,
                                        "sites_per_round": 3})
    current = {"w": np.zeros(20_000, np.float32)}
    result = rule.aggregate_train(RoundInput(1, current, [SiteUpdate("a", current, 10, 1)], {"a": 10, "b": 10, "c": 10},
                                             manifest))
    moves = result.weights["w"].astype(np.float64)
    expected = 1.5 * 0.4 / 3
    assert np.std(moves) == pytest.approx(expected, rel=0.03)  # 20,000 draws: the std within 1.5 % (3 sigma)
    assert abs(np.mean(moves)) < 4 * expected / math.sqrt(moves.size)
    assert result.diagnostics["noise_std"] == pytest.approx(expected)


def test_noise_is_fresh_unless_seeded() -> None:
    seeded = [_round(_rule(), {"a": [0.1, 0.1]})[0]["w"] for _ in range(2)]
    np.testing.assert_array_equal(seeded[0], seeded[1])
    fresh = [_round(build_strategy("dp-fedavg"), {"a": [0.1, 0.1]})[0]["w"] for _ in range(2)]  # type: ignore[arg-type]
    assert not np.array_equal(fresh[0], fresh[1])


@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.8])
def test_adaptive_clip_converges_to_the_target_quantile(quantile: float) -> None:
    """Andrew et al.: with change norms drawn from a fixed distribution, C settles where a fraction `quantile`
    of the norms lies below it (here log-normal norms, 200 sites a round, small count noise)."""
    rng = np.random.default_rng(1)
    rule = _rule(noise_multiplier=0.0, target_quantile=quantile, clip_lr=0.2, clip_norm=0.01, count_stddev=1.0,
                 sites_per_round=200)
    manifest = {"w": _spec("w", (1,), "TRAIN")}
    clips = []
    for round_no in range(1, 301):
        norms = rng.lognormal(mean=0.0, sigma=0.5, size=200)
        updates = [SiteUpdate(f"s{k:03d}", {"w": np.array([n], np.float32)}, 1, 1) for k, n in enumerate(norms)]
        rule.aggregate_train(RoundInput(round_no, {"w": np.zeros(1, np.float32)}, updates,
                                        {u.site_id: 1 for u in updates}, manifest))
        clips.append(rule.clip)
    settled = float(np.mean(clips[-100:]))
    from scipy.stats import lognorm

    true_quantile = float(lognorm(s=0.5).ppf(quantile))
    assert settled == pytest.approx(true_quantile, rel=0.08)
    assert clips[0] > 0.01  # it moved from a start far below every norm


def test_adaptive_clipping_leaves_part_of_the_noise_for_the_count() -> None:
    """z_D = (z^-2 - (2 sigma_b)^-2)^(-1/2): larger than z, and z itself without adaptive clipping."""
    fixed, adaptive = _rule(noise_multiplier=1.0), _rule(noise_multiplier=1.0, target_quantile=0.5, count_stddev=1.0)
    assert fixed.change_noise_multiplier(4) == 1.0
    assert adaptive.change_noise_multiplier(4) == pytest.approx((1.0 - 0.25) ** -0.5)
    with pytest.raises(ConfigError, match="count_stddev"):
        _rule(noise_multiplier=2.0, target_quantile=0.5, count_stddev=1.0)


def test_accountant_reports_the_better_of_opacus_rdp_and_prv_at_q_1_every_round() -> None:
    """Each round one Gaussian release at q = 1 (m = 2 of 8 enrolled sites buys no amplification: the PS's
    selection is not Poisson sampling), epsilon the smaller of Opacus' RDP and PRV accountants' answers."""
    from opacus.accountants import PRVAccountant, RDPAccountant

    rule = _rule(noise_multiplier=1.2, sites_per_round=2)
    epsilons = []
    for round_no in (1, 2, 3):
        _, diag = _round(rule, {"a": [0.1, 0.0], "b": [0.0, 0.1]}, enrolled=8, round_no=round_no)
        references = []
        for reference in (RDPAccountant(), PRVAccountant()):
            reference.history = [(1.2, 1.0, round_no)]
            with warnings.catch_warnings():  # PRV's log(1 - q) at q = 1, a term it then leaves unused
                warnings.simplefilter("ignore", RuntimeWarning)
                references.append(reference.get_epsilon(delta=1e-5))
        assert diag["epsilon"] == pytest.approx(min(references), rel=1e-9)
        assert diag["delta"] == 1e-5
        epsilons.append(diag["epsilon"])
    assert epsilons[0] < epsilons[1] < epsilons[2]
    restored = _rule(noise_multiplier=1.2, sites_per_round=2)
    restored.load_state_dict(rule.state_dict())
    assert restored.epsilon() == pytest.approx(epsilons[-1])


def test_bad_server_state_is_refused() -> None:
    for state in ({"clip": -1.0}, {"clip": float("nan")}, {"noised_rounds": -2}):
        with pytest.raises(ValueError, match="bad server state"):
            _rule().load_state_dict(state)
