"""Distributed DP under secure aggregation (fedmqtt/secagg/skellam.py, ps_daemon/distributed_dp.py): the Skellam
noise has its distribution, the secure sum is exactly the sites' clipped changes plus their noise, with the noise
of the sites in the sum (less when sites drop), the accountant reproduces Opacus' Gaussian numbers in the limit
where the Skellam mechanism becomes the Gaussian one, and the PS refuses configurations it cannot honour."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
from scipy.stats import skellam
from secagg_round import Losses, play, site_ids
from test_machine_secagg import SITES, Sites, _answer, _machine, _start, _train_and_advertise, _trip

from fedmqtt.participant_dp import gaussian_epsilon as participant_epsilon
from fedmqtt.secagg import skellam as sk
from fedmqtt.secagg.ring import FixedPoint
from fedmqtt.secagg.site import SiteSession
from fedmqtt.secagg.weighted import Layout
from fedmqtt.strategies.base import RoundInput
from fedmqtt.strategies.dp_fedavg import DPFedAvg
from ps_daemon import distributed_dp
from ps_daemon import effects as fx
from ps_daemon.config import DaemonConfig
from ps_daemon.events import SiteOffline
from ps_daemon.machine import Machine

KEY = bytes(range(32))


# -- the noise ---------------------------------------------------------------------------------------------------
def test_skellam_noise_has_the_skellam_distribution() -> None:
    """Poisson(v/2) - Poisson(v/2): mean 0, variance v, and the frequencies of scipy's Skellam pmf."""
    v, n = 8.0, 400_000
    draws = sk.skellam_noise(KEY, n, v)
    assert draws.dtype == np.int64
    assert abs(draws.mean()) < 5 * math.sqrt(v / n)
    assert draws.var() == pytest.approx(v, rel=0.02)
    for k in range(-6, 7):
        expected = skellam.pmf(k, v / 2, v / 2)
        assert np.mean(draws == k) == pytest.approx(expected, abs=5 * math.sqrt(expected / n))


def test_noise_is_fixed_by_its_key_and_differs_between_keys() -> None:
    assert np.array_equal(sk.skellam_noise(KEY, 100, 1e6), sk.skellam_noise(KEY, 100, 1e6))
    assert not np.array_equal(sk.skellam_noise(KEY, 100, 1e6), sk.skellam_noise(bytes(32), 100, 1e6))
    with pytest.raises(ValueError, match="128 bits"):
        sk.skellam_noise(b"short", 10, 1.0)


def test_the_noise_key_is_bound_to_the_round_and_the_site() -> None:
    from fedmqtt.secagg.context import RoundContext

    secret = bytes(32)
    one, two = RoundContext("run", 1, 5), RoundContext("run", 2, 5)
    assert sk.noise_key(one, secret, "a") != sk.noise_key(two, secret, "a") != sk.noise_key(one, secret, "b")
    assert sk.noise_key(one, secret, "a") == sk.noise_key(RoundContext("run", 1, 5), secret, "a")


def test_change_vector_clips_one_l2_norm_over_all_tensors() -> None:
    layout = Layout(("a", "b"), ((2,), (1,)), ("float32", "float32"))
    vector = sk.change_vector({"b": np.array([4.0], np.float32), "a": np.array([0.0, 3.0], np.float32)}, layout, 1.0)
    assert vector == pytest.approx([0.0, 0.6, 0.8, 0.0])  # norm 5 -> 1, then the weight's slot carries 0
    assert sk.clip_l2(np.array([0.3, 0.4]), 1.0) == pytest.approx([0.3, 0.4])  # short enough: unchanged
    with pytest.raises(ValueError, match="finite"):
        sk.clip_l2(np.array([np.nan]), 1.0)


# -- the accountant ------------------------------------------------------------------------------------------------
def _opacus_gaussian(z: float, rounds: int) -> float:
    """Opacus' epsilon of `rounds` Gaussian releases of multiplier z at q = 1, at delta 1e-5, on our orders."""
    rdp = compute_rdp(q=1.0, noise_multiplier=z, steps=rounds, orders=list(sk.ORDERS))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the")
        return float(get_privacy_spent(orders=list(sk.ORDERS), rdp=rdp, delta=1e-5)[0])


def test_rdp_closed_form_by_hand() -> None:
    """alpha Delta_2^2 / (2 v) + min(((2 alpha - 1) Delta_2^2 + 6 Delta_1) / (4 v^2), 3 Delta_1 / (2 v))."""
    assert sk.skellam_rdp(2, 1.0, 1.0, 4.0) == pytest.approx(2 / 8 + min(9 / 64, 3 / 8))  # the first branch
    assert sk.skellam_rdp(2, 1.0, 1.0, 1.0) == pytest.approx(1.0 + min(9 / 4, 3 / 2))  # the second
    with pytest.raises(ValueError, match="integer orders"):
        sk.skellam_rdp(1, 1.0, 1.0, 1.0)


@pytest.mark.parametrize("z", [0.7, 1.0, 2.0, 5.0])
@pytest.mark.parametrize("rounds", [1, 10, 100])
def test_epsilon_converges_to_opacus_gaussian_from_above(z: float, rounds: int) -> None:
    """With the ring's scale 2^16 the Skellam mechanism of variance (z Delta_2)^2 is all but the Gaussian of
    multiplier z: its epsilon is at least Opacus' (q = 1, the same orders) and within 0.1 % of it, and within a
    few per cent of Opacus' own accountant with its default orders where epsilon is below 20."""
    plan = sk.SkellamPlan(clip=1.0, noise_multiplier=z, expected_sites=1, fraction_bits=16, dim=1000)
    ours = sk.skellam_epsilon([(plan.l1, plan.l2, plan.site_variance)] * rounds, 1e-5)
    gaussian = _opacus_gaussian(z, rounds)
    assert gaussian <= ours <= gaussian * 1.001
    if gaussian < 20:  # beyond, Opacus' fractional orders (down to 1.1) give it a tighter bound than ours (>= 2)
        assert ours == pytest.approx(participant_epsilon(z, 1.0, rounds, 1e-5), rel=0.05)


def test_coarse_noise_costs_more_than_the_gaussian() -> None:
    """At a small scale the Skellam term beyond the Gaussian one matters: the accountant charges it."""
    plan = sk.SkellamPlan(clip=1.0, noise_multiplier=1.0, expected_sites=1, fraction_bits=0, dim=1)
    ours = sk.skellam_epsilon([(plan.l1, plan.l2, plan.site_variance)] * 10, 1e-5)
    gaussian = _opacus_gaussian(1.0, 10)
    assert ours > gaussian * 1.3  # variance 2.25 in ring units: 27.9 against 19.8


# -- the secure sum --------------------------------------------------------------------------------------------------
def test_the_secure_sum_is_the_clipped_changes_plus_the_noise_of_the_sites_in_it() -> None:
    """Six sites, one lost before its masked input: the PS's sum is exactly the five others' encoded clipped
    changes plus their five noise shares (none of the lost site's), and its noise has the std of five shares."""
    n, d = 6, 5000
    names = site_ids(n)
    plan = sk.SkellamPlan(clip=1.0, noise_multiplier=1.0, expected_sites=n, fraction_bits=16, dim=d)
    layout = Layout(("w",), ((d,),), ("float32",))
    rng = np.random.default_rng(7)
    changes = {s: {"w": rng.normal(scale=0.05, size=d).astype(np.float32)} for s in names}  # norms ~3.5: clipped
    vectors = {s: sk.change_vector(changes[s], layout, plan.clip) for s in names}
    noises: dict[str, np.ndarray] = {}

    def noise(site: SiteSession) -> np.ndarray:
        noises[site.site] = sk.site_noise(plan, sk.noise_key(site.ctx, site.secrets.cipher_private, site.site), layout)
        return noises[site.site]

    fixed = FixedPoint(clip=1.0, fraction_bits=16, bits=32, max_sites=n)
    assert sk.reach_problem(plan, n, 32) is None
    played = play(n, layout.length, fixed=fixed, updates=vectors, noise=noise,
                  losses=Losses(before_masked={names[0]}))
    total = played.outcome
    assert not isinstance(total, type(None)) and hasattr(total, "total"), total
    included = names[1:]
    assert tuple(total.included) == tuple(included)
    exact = sum(np.rint(vectors[s] * plan.scale).astype(np.int64) + noises[s] for s in included)
    assert np.array_equal(total.total, exact / plan.scale)  # nothing lost but the rounding to the ring
    clipped = sum(vectors[s] for s in included)
    assert max(np.linalg.norm(vectors[s][:d]) for s in names) == pytest.approx(1.0)  # every change was clipped
    error = (total.total - clipped)[:d]
    assert error.std() == pytest.approx(plan.sum_std(5), rel=0.05)
    assert plan.sum_std(5) == pytest.approx(math.sqrt(5 / 6) * plan.l2 / plan.scale)  # less noise: one dropped
    assert abs(error.mean()) < 5 * plan.sum_std(5) / math.sqrt(d)
    assert total.total[d] == 0.0  # the weight's slot: no weight, no noise


# -- DP-FedAvg from the noised sum ----------------------------------------------------------------------------------
def test_dp_fedavg_steps_by_the_noised_sum_over_m_and_charges_what_the_sum_had() -> None:
    rule = DPFedAvg({"clip_norm": 1.0, "noise_multiplier": 1.0, "sites_per_round": 4.0})
    plan = sk.SkellamPlan(clip=1.0, noise_multiplier=1.0, expected_sites=4, fraction_bits=16, dim=3)
    current = {"w": np.array([1.0, 2.0, 3.0], np.float32), "steps": np.array(7, np.int64)}
    inp = RoundInput(1, current, [], {s: 10 for s in "abcd"}, {})
    out = rule.aggregate_noised_sum(inp, {"w": np.array([0.4, -0.8, 2.0])}, plan, 4)
    assert out.weights["w"] == pytest.approx([1.1, 1.8, 3.5])  # w + sum / m
    assert out.weights["steps"] == 7  # integer buffers keep the server's value
    full = out.diagnostics["epsilon"]
    assert full == pytest.approx(sk.skellam_epsilon([(plan.l1, plan.l2, 4 * plan.site_variance)], 1e-5))
    second = rule.aggregate_noised_sum(inp, {"w": np.zeros(3)}, plan, 4).diagnostics["epsilon"]
    assert second > full
    dropped = DPFedAvg({"clip_norm": 1.0, "noise_multiplier": 1.0, "sites_per_round": 4.0})
    assert dropped.aggregate_noised_sum(inp, {"w": np.zeros(3)}, plan, 2).diagnostics["epsilon"] > full * 1.3
    restored = DPFedAvg({"clip_norm": 1.0, "noise_multiplier": 1.0})
    restored.load_state_dict(rule.state_dict())
    assert restored.skellam_releases == rule.skellam_releases
    with pytest.raises(ValueError, match="skellam_releases"):
        restored.load_state_dict({"skellam_releases": [[1.0, 1.0, -1.0]]})


# -- the PS's config -------------------------------------------------------------------------------------------------
def _config(**overrides: object) -> DaemonConfig:
    raw: dict[str, object] = {
        "run_id": "ddp", "sites": list(site_ids(4)), "rounds": 2, "model": {"name": "mlp", "args": {}},
        "credentials": "creds.toml", "algorithm": "dp-fedavg", "hyper": {"clip_norm": 0.5, "noise_multiplier": 1.0},
        "secure_aggregation": {"enabled": True, "distributed_dp": "skellam"}}
    for key, value in overrides.items():
        if key == "secure_aggregation" and isinstance(value, dict):
            raw[key] = {**raw[key], **value}  # type: ignore[dict-item]
        else:
            raw[key] = value
    return DaemonConfig.model_validate(raw)


def test_config_calibrates_the_noise_for_the_sites_that_survive_the_planned_dropout() -> None:
    terms = distributed_dp.terms_of(_config(secure_aggregation={"dropout": 0.3}))
    assert terms is not None and (terms.clip, terms.noise_multiplier) == (0.5, 1.0)
    assert terms.expected_sites == 3  # ceil(0.7 * 4)
    assert distributed_dp.terms_of(_config(secure_aggregation={"distributed_dp": "off"}, algorithm="fedavg",
                                           hyper={})) is None


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"algorithm": "fedavg", "hyper": {}}, "dp-fedavg"),
    ({"hyper": {"target_quantile": 0.5}, "secure_aggregation": {"fraction_bits": 0}}, "fraction_bits >= 1"),
    ({"hyper": {"noise_multiplier": 0.0}}, "needs noise"),
    ({"secure_aggregation": {"enabled": False}}, "enabled = true"),
    ({"secure_aggregation": {"fraction_bits": 28}}, "ring_bits = 64"),
    ({"sites": site_ids(2)}, "at least 3 sites"),
])
def test_config_refuses_what_distributed_dp_cannot_honour(overrides: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        _config(**overrides)


def test_a_64_bit_ring_holds_what_a_32_bit_one_cannot() -> None:
    _config(secure_aggregation={"fraction_bits": 28, "ring_bits": 64})


# -- the PS state machine with the site driver -------------------------------------------------------------------------
def test_a_round_under_distributed_dp_through_the_ps(tmp_path: Path) -> None:
    """Four sites play their part with the site driver (site_agent/secagg_round.py) over the wire kinds; each
    hands it its model change: the model moves by exactly (the encoded clipped changes + the four noise shares)
    / (gamma m), and the round's record carries the epsilon of a sum of four shares."""
    hyper = {"clip_norm": 0.5, "noise_multiplier": 0.3}
    machine = _machine(DPFedAvg(hyper), algorithm="dp-fedavg", hyper=hyper,
                       secure_aggregation={"enabled": True, "stage_timeout_s": 10.0, "fraction_bits": 20,
                                           "clip": 4.0, "distributed_dp": "skellam"})
    sites = Sites(tmp_path, machine)
    state, effects = _start(machine)
    state, effects = _train_and_advertise(machine, sites, state, effects)
    for _ in range(3):  # shares, masked inputs, unmasking answers
        state, effects = _answer(machine, sites, state, effects)
    assert state.round == 2 and state.history[-1].sites == SITES
    layout = next(iter(sites.rounds.values())).layout
    plan = sites.rounds[SITES[0]].dp
    assert plan is not None and plan.expected_sites == 4 and plan.dim == layout.floats == 8
    integer = np.zeros(layout.length, np.int64)
    for s in SITES:
        sr = sites.rounds[s]
        vector = sk.change_vector(sites.trained[s], layout, 0.5)
        integer += np.rint(vector * plan.scale).astype(np.int64)
        integer += sk.site_noise(plan, sk.noise_key(sr.ctx, sr.session_state.secrets.cipher_private, s), layout)
    step = integer / plan.scale / 4
    at = 0
    for name, shape in zip(layout.names, layout.shapes, strict=True):
        size = int(np.prod(shape))
        assert state.weights[name] == pytest.approx(step[at:at + size].reshape(shape).astype(np.float32)), name
        at += size
    server = state.history[-1].server
    assert server["sites_in_sum"] == 4.0 and server["noise_calibrated_for"] == 4.0
    assert server["epsilon"] == pytest.approx(sk.skellam_epsilon([(plan.l1, plan.l2, 4 * plan.site_variance)], 1e-5))
    # ps/status says the same epsilon, by the Skellam bound, after one charged round
    spent = [e for e in effects if isinstance(e, fx.PublishStatus)][-1].participant_dp
    assert spent is not None
    assert (spent.epsilon, spent.delta, spent.accountant, spent.rounds) == (server["epsilon"], 1e-5, "skellam", 1)


def _ddp_machine() -> Machine:
    hyper = {"clip_norm": 0.5, "noise_multiplier": 0.3}
    return _machine(DPFedAvg(hyper), algorithm="dp-fedavg", hyper=hyper,
                    secure_aggregation={"enabled": True, "stage_timeout_s": 10.0, "fraction_bits": 20, "clip": 4.0,
                                        "distributed_dp": "skellam"})


def test_a_site_lost_before_its_masked_input_leaves_less_noise_and_the_ps_says_so(tmp_path: Path) -> None:
    machine = _ddp_machine()
    sites = Sites(tmp_path, machine)
    state, effects = _start(machine)
    state, effects = _train_and_advertise(machine, sites, state, effects)
    state, effects = _answer(machine, sites, state, effects)  # shares
    state, effects = _answer(machine, sites, state, effects, silent=("site-003",))
    state, effects = machine.step(state, SiteOffline("site-003", now=3.0))
    state, effects = _answer(machine, sites, state, effects)
    assert state.round == 2 and state.history[-1].secure["dropped"] == ["site-003"]
    server = state.history[-1].server
    assert server["sites_in_sum"] == 3.0 and server["noise_calibrated_for"] == 4.0
    plan = sites.rounds[SITES[0]].dp
    assert plan is not None
    assert server["epsilon"] == pytest.approx(sk.skellam_epsilon([(plan.l1, plan.l2, 3 * plan.site_variance)], 1e-5))
    assert server["epsilon"] > sk.skellam_epsilon([(plan.l1, plan.l2, 4 * plan.site_variance)], 1e-5)
    assert any(isinstance(e, fx.Log) and e.level == "warning" and "only 3 sites' noise" in e.text for e in effects)


def test_a_restarted_site_masks_the_same_bits(tmp_path: Path) -> None:
    """The noise key comes from the round's kept secret: the site driver rebuilt from its store after a restart
    sends the same masked input (so the PS takes it as a copy, not as a second, different input)."""
    machine = _ddp_machine()
    sites = Sites(tmp_path, machine)
    state, effects = _start(machine)
    tasks = {e.site_id: e for e in effects if isinstance(e, fx.PublishTrainTask)}
    state, effects = _train_and_advertise(machine, sites, state, effects)
    state, effects = _answer(machine, sites, state, effects)  # shares -> inboxes
    site = SITES[1]
    inbox = next(_trip(e.message) for e in effects if isinstance(e, fx.PublishSecAgg) and e.site_id == site)
    first = sites.rounds[site].on_inbox(inbox, sites.trained[site], sites.counts[site])
    again = sites.driver(site, state, tasks[site]).on_inbox(inbox, sites.trained[site], sites.counts[site])
    assert (again.masked, again.paired_with) == (first.masked, first.paired_with)
    other = dict(sites.trained[site], **{"fc.bias": np.zeros(2, np.float32)})
    assert sites.driver(site, state, tasks[site]).on_inbox(inbox, other, sites.counts[site]).masked != first.masked
