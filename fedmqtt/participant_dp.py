"""Participant-level epsilon of a DP-FedAvg run (docs/privacy.md), from its public terms: what the PS reports and
what a site recomputes on its own, before it trains, to judge a run against its policy (it never takes the PS's
word for it). Opacus' accountants, imported when called: they bring torch, which only DP runs need.

Each round is one release: the Gaussian mechanism of multiplier z on the sum of clipped changes (the clear form),
or the Skellam mechanism with the sum of `expected_sites` sites' shares (the distributed form). No amplification
by sampling: the PS selects every site, or a fixed-size draw seeded by the run's public seed, neither of which is
the Poisson sampling with secret randomness that amplification assumes, so every round is charged at q = 1.
"""

from __future__ import annotations

import functools
import math
import warnings

from fedmqtt.secagg.skellam import SkellamPlan, skellam_epsilon


@functools.lru_cache(maxsize=256)  # pure; the PS asks again for every site while it waits
def gaussian_epsilon(noise_multiplier: float, sample_rate: float, rounds: int, delta: float) -> float:
    """epsilon at `delta` after `rounds` steps of the sampled Gaussian mechanism (Opacus' RDP accountant)."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(float(noise_multiplier), float(sample_rate), int(rounds))]
    with warnings.catch_warnings():
        # the optimal order at the edge of the default orders: epsilon is still an upper bound
        warnings.filterwarnings("ignore", message="Optimal order is the")
        return float(accountant.get_epsilon(delta=delta))


@functools.lru_cache(maxsize=256)
def skellam_run_epsilon(plan: SkellamPlan, rounds: int, delta: float) -> float:
    """epsilon at `delta` of `rounds` Skellam releases, each the sum of the `plan.expected_sites` sites' shares."""
    release = (plan.l1, plan.l2, plan.expected_sites * plan.site_variance)
    return skellam_epsilon([release] * rounds, delta)
