"""Participant-level epsilon of a DP-FedAvg run (docs/privacy.md), from its public terms: what the PS reports and
what a site recomputes on its own, before it trains, to judge a run against its policy (it never takes the PS's
word for it). Opacus' accountants, imported when called: they bring torch, which only DP runs need.

Each round is one release: the Gaussian mechanism of multiplier z on the sum of clipped changes (the clear form),
or the Skellam mechanism with the sum of `expected_sites` sites' shares (the distributed form). No amplification
by sampling: the PS selects every site, or a fixed-size draw seeded by the run's public seed
(fedmqtt.recruitment.sample_sites), neither of which is the Poisson sampling with secret randomness that
amplification assumes, so every round is charged at q = 1.

The Gaussian form has two accountants: Opacus' RDP (Mironov) and PRV (Gopi, Lee and Wutschitz, numerical
composition; Opacus returns the upper end of its error interval). Both give upper bounds, so the smaller is one
too: `best_gaussian_epsilon`. At delta 1e-5 RDP cannot certify an epsilon below about 0.2 whatever the noise (its
conversion's log(1/delta) / (alpha - 1) term at Opacus' largest order); PRV can. The Skellam form has RDP only.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from fedmqtt.secagg.skellam import SkellamPlan, skellam_epsilon

Accountant = Literal["rdp", "prv"]
ACCOUNTANTS: tuple[Accountant, ...] = ("rdp", "prv")
PRV_UP_TO = 10.0  # `best_gaussian_epsilon` asks PRV only below this RDP epsilon


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        # the optimal order at the edge of the default orders: epsilon is still an upper bound
        warnings.filterwarnings("ignore", message="Optimal order is the")
        # PRV's log(1 - q) at q = 1: a term q = 1 leaves unused
        warnings.filterwarnings("ignore", message="divide by zero encountered in log", category=RuntimeWarning)
        # PRV's grid at the search's far ends (get_noise_multiplier tries extreme noise): those tries fail over
        warnings.filterwarnings("ignore", message="(overflow|invalid value|divide by zero) encountered",
                                category=RuntimeWarning)
        yield


def load_accountants() -> None:
    """Import Opacus' accountants (and torch with them) now: the first epsilon a PS computes would otherwise pay
    for that import inside its loop, about 2-3 s here, in the middle of closing round 1."""
    import opacus.accountants  # noqa: F401


@functools.lru_cache(maxsize=256)  # pure; the PS asks again for every site while it waits
def gaussian_epsilon(noise_multiplier: float, sample_rate: float, rounds: int, delta: float,
                     accountant: Accountant = "rdp") -> float:
    """epsilon at `delta` after `rounds` steps of the sampled Gaussian mechanism, by Opacus' `accountant`."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    from opacus.accountants import PRVAccountant, RDPAccountant

    acc = PRVAccountant() if accountant == "prv" else RDPAccountant()
    acc.history = [(float(noise_multiplier), float(sample_rate), int(rounds))]
    with _quiet():
        return float(acc.get_epsilon(delta=delta))


def best_gaussian_epsilon(noise_multiplier: float, rounds: int, delta: float) -> tuple[float, Accountant]:
    """The smaller of the RDP and PRV epsilons of `rounds` Gaussian releases at q = 1, and whose it is. PRV only
    where RDP says at most PRV_UP_TO: above it PRV's grid grows (seconds to minutes on low noise and many rounds)
    for a gain of a few percent on an epsilon no policy accepts anyway."""
    rdp = gaussian_epsilon(noise_multiplier, 1.0, rounds, delta, "rdp")
    if not rdp <= PRV_UP_TO:
        return rdp, "rdp"
    try:
        prv = gaussian_epsilon(noise_multiplier, 1.0, rounds, delta, "prv")
    except (ValueError, RuntimeError, OverflowError, MemoryError):  # PRV's domain at extreme terms
        return rdp, "rdp"
    return (prv, "prv") if prv < rdp else (rdp, "rdp")


@functools.lru_cache(maxsize=64)
def noise_for(target_epsilon: float, rounds: int, delta: float) -> float | None:
    """The smallest noise multiplier whose `rounds` Gaussian releases at q = 1 cost at most `target_epsilon` by
    either accountant (Opacus' `get_noise_multiplier`); None when neither reaches it."""
    from opacus.accountants.utils import get_noise_multiplier

    found = []
    for kind in ACCOUNTANTS:
        try:
            with _quiet():
                found.append(float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta,
                                                        sample_rate=1.0, steps=rounds, accountant=kind)))
        except (ValueError, RuntimeError, OverflowError, MemoryError):
            continue
    return min(found) if found else None


@functools.lru_cache(maxsize=256)
def skellam_run_epsilon(plan: SkellamPlan, rounds: int, delta: float) -> float:
    """epsilon at `delta` of `rounds` Skellam releases, each the sum of the `plan.expected_sites` sites' shares (the
    change's, and the clipped count's with adaptive clipping)."""
    return skellam_epsilon(plan.releases(plan.expected_sites) * rounds, delta)
