"""A site's label histogram released under differential privacy (recruitment and FedDkw read it): the Gaussian
mechanism on the label counts, once, charged to the site's privacy ledger like a DP-SGD round.

One record changes its site's counts by at most 1 in one bin (classification, length-of-stay bins: L2 sensitivity
1) or by 1 in each of the K labels it is positive for (multilabel: sqrt(K)). The site adds N(0, (z Delta)^2) to
every count, z the noise multiplier that spends the policy's epsilon at its delta in one release, then rounds and
clamps at 0 (post-processing, free). The release is the Gaussian mechanism of multiplier z, which is exactly one
step of Opacus' sampled Gaussian at q = 1: the ledger records it as (z, 1, 1) and both of Opacus' accountants
compose it with the site's DP-SGD rounds.

z is calibrated by Opacus (`get_noise_multiplier`, one step at q = 1) with both of its accountants, and the larger
is taken, so the release costs at most epsilon whichever accountant the site's tasks use; below epsilon ~0.2 at
delta 1e-5 Opacus' RDP orders (up to 63) cannot reach the target and PRV's calibration alone is used.

Or the Laplace mechanism (Dwork, McSherry, Nissim and Smith, Calibrating noise to sensitivity), pure epsilon-DP:
every count gets Laplace noise of scale b = Delta_1 / epsilon, Delta_1 the L1 sensitivity (1 for classes and bins,
K for a multilabel record positive for all K labels). No delta; the ledger charges it as a pure-epsilon release
(site_agent/privacy_ledger.py says how it composes with the Gaussian history).

The noise is drawn from a generator seeded with fresh operating-system randomness, never the run's seed.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping
from typing import Literal

import numpy as np

ACCOUNTANTS = ("rdp", "prv")


def sensitivity(task_kind: str, n_bins: int) -> float:
    """L2 sensitivity of the counts to one record (see the module text)."""
    return math.sqrt(max(n_bins, 1)) if task_kind == "multilabel" else 1.0


def l1_sensitivity(task_kind: str, n_bins: int) -> float:
    """L1 sensitivity of the counts to one record: one count, or every label of a multilabel record."""
    return float(max(n_bins, 1)) if task_kind == "multilabel" else 1.0


def laplace_scale(epsilon: float, task_kind: str, n_bins: int) -> float:
    """b = Delta_1 / epsilon: the Laplace mechanism's scale for pure epsilon-DP."""
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"the Laplace mechanism needs a positive epsilon, not {epsilon}")
    return l1_sensitivity(task_kind, n_bins) / epsilon


@functools.lru_cache(maxsize=64)
def noise_multiplier(epsilon: float, delta: float) -> float:
    """z such that one Gaussian release of multiplier z costs at most (epsilon, delta) by each accountant that
    can reach it (ValueError when none can)."""
    from opacus.accountants.utils import get_noise_multiplier  # torch: sites have it

    found = []
    for kind in ACCOUNTANTS:
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Optimal order is the")
                # PRV's log(1 - q) at q = 1: a term q = 1 leaves unused
                warnings.filterwarnings("ignore", message="divide by zero encountered in log", category=RuntimeWarning)
                found.append(float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=1.0,
                                                        steps=1, accountant=kind)))
        except ValueError:  # this accountant cannot certify so small an epsilon
            continue
    if not found:
        raise ValueError(f"no accountant reaches epsilon {epsilon:g} at delta {delta:g} for a label histogram")
    return max(found)


def noised_histogram(counts: Mapping[str, int], std: float, rng: np.random.Generator,
                     mechanism: Literal["gaussian", "laplace"] = "gaussian") -> dict[str, int]:
    """Every count plus N(0, std^2) (or, `laplace`, Laplace noise of scale `std`), rounded and clamped at 0."""
    keys = sorted(counts)
    noise = rng.laplace(0.0, std, size=len(keys)) if mechanism == "laplace" else rng.normal(0.0, std, size=len(keys))
    raw = np.array([float(counts[k]) for k in keys]) + noise
    return {k: max(int(round(v)), 0) for k, v in zip(keys, raw, strict=True)}
