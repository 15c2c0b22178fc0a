"""What the PS declares with every training task about the participant-level DP its released models are under
(DP-FedAvg), and what those terms cost by the same accountant a site uses to judge them (fedmqtt/participant_dp.py):
the sites recompute it on their own before they train, and the PS checks it against their published policies
before round 1 (ps_daemon/policy_quorum.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import numpy as np

from fedmqtt.participant_dp import best_gaussian_epsilon, skellam_run_epsilon
from fedmqtt.strategies.dp_fedavg import DPFedAvgParams
from ps_daemon.config import DaemonConfig
from ps_daemon.distributed_dp import ALGORITHM, plan_of
from schemas.messages import ParticipantDP


def participant_terms(config: DaemonConfig) -> ParticipantDP | None:
    """The run's participant-level DP terms; None when its rule releases models without it."""
    if config.algorithm != ALGORITHM:
        return None
    p = DPFedAvgParams.model_validate(config.strategy_params())
    mechanism: Literal["gaussian", "skellam"] = "gaussian" if config.secure_aggregation.distributed_dp == "off" \
        else "skellam"
    return ParticipantDP(mechanism=mechanism, noise_multiplier=p.noise_multiplier, rounds=config.rounds,
                         delta=p.delta)


def run_epsilon(config: DaemonConfig, terms: ParticipantDP, weights: Mapping[str, np.ndarray]) -> float:
    """The run's epsilon as a site's accountant makes it (q = 1, the better of RDP and PRV); under Skellam with d
    the float coordinates of `weights`, the shared tensors: what the sites send back and size their noise with."""
    if terms.mechanism == "gaussian":
        return best_gaussian_epsilon(terms.noise_multiplier, terms.rounds, terms.delta)[0]
    dim = sum(int(np.size(v)) for v in weights.values() if np.asarray(v).dtype.kind == "f")
    p = DPFedAvgParams.model_validate(config.strategy_params())
    try:
        plan = plan_of(config.secure_aggregation, p, len(config.sites), max(1, dim))
    except ValueError:
        return math.inf
    return skellam_run_epsilon(plan, terms.rounds, terms.delta)
