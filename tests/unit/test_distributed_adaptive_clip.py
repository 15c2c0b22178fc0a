"""Adaptive clipping (Andrew et al.) under distributed DP: each site sends its clipped-count entry b - 1/2 in the
masked vector's last slot with Skellam noise of its own, the PS moves C from the noised count it unmasks, tells the
sites the new C with the next round's tasks, and charges each round both releases; together they cost what one
Gaussian of the run's multiplier z costs (in the limit where Skellam becomes Gaussian)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
from test_machine_secagg import SITES, Sites, _answer, _machine, _start, _train_and_advertise

from fedmqtt.participant_dp import gaussian_epsilon, skellam_run_epsilon
from fedmqtt.secagg import skellam as sk
from fedmqtt.secagg.weighted import layout_of
from fedmqtt.strategies.dp_fedavg import DPFedAvg
from ps_daemon import effects as fx

HYPER = {"clip_norm": 0.5, "noise_multiplier": 0.3, "target_quantile": 0.5, "clip_lr": 0.2, "count_stddev": 0.4}


def test_the_count_entry_is_centred_and_noised_with_its_own_share() -> None:
    layout = layout_of({"w": np.zeros(2, np.float32)})
    small, large = {"w": np.array([0.3, 0.0], np.float32)}, {"w": np.array([3.0, 4.0], np.float32)}
    assert sk.change_vector(small, layout, 1.0, count=True)[-1] == 0.5
    assert sk.change_vector(large, layout, 1.0, count=True)[-1] == -0.5
    assert sk.change_vector(large, layout, 1.0)[-1] == 0.0  # fixed clip: the weight's slot carries 0
    plan = sk.SkellamPlan(clip=1.0, noise_multiplier=1.0, expected_sites=4, fraction_bits=16, dim=2,
                          count_stddev=2.0)
    assert plan.count_site_variance == pytest.approx((2.0 * 2**16) ** 2 / 4)
    assert plan.effective_multiplier == pytest.approx((1.0 + 1 / 16) ** -0.5)
    draws = np.array([sk.site_noise(plan, bytes([i]) * 32, layout)[-1] for i in range(200)], np.float64)
    assert draws.std() == pytest.approx(math.sqrt(plan.count_site_variance), rel=0.2)
    fixed = sk.SkellamPlan(clip=1.0, noise_multiplier=1.0, expected_sites=4, fraction_bits=16, dim=2)
    assert sk.site_noise(fixed, bytes(32), layout)[-1] == 0
    with pytest.raises(ValueError, match="fraction_bits >= 1"):
        sk.SkellamPlan(clip=1.0, noise_multiplier=1.0, expected_sites=4, fraction_bits=0, dim=2, count_stddev=1.0)


@pytest.mark.parametrize("rounds", [1, 10])
def test_both_releases_together_cost_about_one_gaussian_of_multiplier_z(rounds: int) -> None:
    """z_D = (z^-2 - (2 sigma_b)^-2)^(-1/2) for the change, sigma_b for the count: at gamma = 2^20 the Skellam
    accountant's epsilon of the pair is within 0.5 % above Opacus' Gaussian RDP epsilon at z on the same orders."""
    z, sigma_b = 1.0, 2.0
    z_d = (z**-2 - (2 * sigma_b) ** -2) ** -0.5
    plan = sk.SkellamPlan(clip=1.0, noise_multiplier=z_d, expected_sites=4, fraction_bits=20, dim=100,
                          count_stddev=sigma_b)
    assert plan.effective_multiplier == pytest.approx(z)
    orders = list(sk.ORDERS)  # the Skellam bound's integer orders, for the Gaussian reference too
    gaussian, _ = get_privacy_spent(orders=orders, rdp=compute_rdp(q=1.0, noise_multiplier=z, steps=rounds,
                                                                   orders=orders), delta=1e-5)
    ours = skellam_run_epsilon(plan, rounds, 1e-5)
    assert gaussian <= ours <= 1.005 * gaussian
    assert ours >= gaussian_epsilon(z, 1.0, rounds, 1e-5) * 0.95  # and near Opacus' own (fractional orders too)


def test_a_round_moves_the_clip_from_the_count_summed_under_secure_aggregation(tmp_path: Path) -> None:
    machine = _machine(DPFedAvg(HYPER), algorithm="dp-fedavg", hyper=HYPER,
                       secure_aggregation={"enabled": True, "stage_timeout_s": 10.0, "fraction_bits": 20,
                                           "clip": 4.0, "distributed_dp": "skellam"})
    sites = Sites(tmp_path, machine)
    state, effects = _start(machine)
    first = next(e.secure for e in effects if isinstance(e, fx.PublishTrainTask))
    assert first is not None and first.distributed_dp is not None
    terms = first.distributed_dp
    assert terms.clip == 0.5 and terms.count_stddev == 0.4  # sigma_b as configured
    assert terms.noise_multiplier == pytest.approx((0.3**-2 - 0.8**-2) ** -0.5)  # z_D
    state, effects = _train_and_advertise(machine, sites, state, effects)
    for _ in range(3):  # shares, masked inputs, unmasking answers
        state, effects = _answer(machine, sites, state, effects)
    assert state.round == 2 and state.history[-1].sites == SITES
    layout = next(iter(sites.rounds.values())).layout
    plan = sites.rounds[SITES[0]].dp
    assert plan is not None and plan.count_stddev == 0.4
    # the count the PS unmasked: the sites' b - 1/2 and their count noise, exactly
    entries = [sk.change_vector(sites.trained[s], layout, 0.5, count=True)[-1] for s in SITES]
    noise = sum(int(sk.site_noise(plan, sk.noise_key(sites.rounds[s].ctx,
                                                     sites.rounds[s].session_state.secrets.cipher_private, s),
                                  layout)[-1]) for s in SITES)
    count = sum(entries) + noise / plan.scale + len(SITES) / 2
    server = state.history[-1].server
    assert server["noisy_unclipped_fraction"] == pytest.approx(count / 4)
    want = 0.5 * math.exp(-0.2 * (count / 4 - 0.5))
    assert server["next_clip_norm"] == pytest.approx(want)
    assert server["epsilon"] == pytest.approx(sk.skellam_epsilon(plan.releases(4), 1e-5))
    assert server["epsilon"] > sk.skellam_epsilon(plan.releases(4)[:1], 1e-5)  # the count is charged too
    # the next round's tasks carry the new clip
    second = next(e.secure for e in effects if isinstance(e, fx.PublishTrainTask))
    assert second is not None and second.distributed_dp is not None
    assert second.distributed_dp.clip == pytest.approx(want)
