"""What a site hands secure aggregation under distributed DP (DP-FedAvg with the noise added by the sites,
fedmqtt/secagg/skellam.py): its model change, w_i - w_t, on every float tensor it shares. The clipping and the noise
come when it masks (site_agent/secagg_round.py), so the stored update (kept to resume after a restart) holds the
exact change and the same noise is drawn again from the round's kept secret. Also what this site's own accountant
makes of the run's participant-level terms, and how much noise its policy makes it add (`own_share`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from fedmqtt.participant_dp import best_gaussian_epsilon, skellam_run_epsilon
from fedmqtt.secagg.skellam import SkellamPlan
from schemas.messages import GlobalModel, ParticipantDP, TrainTask


def model_change(trained: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """w_i - w_t for every float tensor of `trained` (in its dtype); other tensors as trained (they are not summed).
    KeyError: a float tensor the starting model lacks (the change would be undefined)."""
    out: dict[str, np.ndarray] = {}
    for name, value in trained.items():
        array = np.asarray(value)
        if array.dtype.kind != "f":
            out[name] = array
            continue
        base = np.asarray(start[name], dtype=np.float64)
        if base.shape != array.shape:
            raise ValueError(f"{name}: the trained tensor has shape {array.shape}, the round's model {base.shape}")
        out[name] = (array.astype(np.float64) - base).astype(array.dtype)
    return out


def shared_floats(task: TrainTask, model: GlobalModel) -> int:
    """d: the coordinates of the float tensors this site will send back (the change distributed DP sums)."""
    upload = None if task.upload is None else set(task.upload)
    return sum(math.prod(b.shape) for b in model.tensors
               if b.dtype.startswith(("float", "bfloat")) and (upload is None or b.name in upload))


def run_epsilon(task: TrainTask, model: GlobalModel, terms: ParticipantDP) -> tuple[float, str]:
    """The run's participant-level epsilon by this site's own accountant, from the task's declared terms, and which
    accountant gave it: the better of RDP and PRV for the Gaussian form, the Skellam RDP bound with the model's
    real size d for the distributed one; infinity for terms no mechanism could honour."""
    if terms.mechanism == "gaussian":
        return best_gaussian_epsilon(terms.noise_multiplier, terms.rounds, terms.delta)
    sa = task.secure_aggregation
    if sa is None or sa.distributed_dp is None:
        return math.inf, "rdp"
    dp = sa.distributed_dp
    try:
        plan = SkellamPlan(dp.clip, dp.noise_multiplier, dp.expected_sites, sa.fraction_bits,
                           max(1, shared_floats(task, model)), dp.count_stddev)
    except ValueError:
        return math.inf, "rdp"
    return skellam_run_epsilon(plan, terms.rounds, terms.delta), "rdp"


def own_share(plan: SkellamPlan, min_noise_multiplier: float | None, roster_sites: int | None) -> SkellamPlan:
    """The noise this site adds: the PS's share, or more when this site's policy demands more. The policy's
    floor z_min holds for the sum of the shares the round can hold at most: the PS's `expected_sites`, or fewer
    when fewer sites are in the round's roster (a PS that claimed more sites than it has would otherwise thin
    every share). With adaptive clipping the floor is on the two releases together (`effective_multiplier`):
    both shares grow by the same factor. Without a floor: the PS's share as asked."""
    if min_noise_multiplier is None:
        return plan
    sites = min(plan.expected_sites, roster_sites) if roster_sites else plan.expected_sites
    factor = min_noise_multiplier / plan.effective_multiplier
    floor = replace(plan, noise_multiplier=plan.noise_multiplier * factor,
                    count_stddev=plan.count_stddev * factor, expected_sites=max(1, sites))
    return floor if floor.site_variance > plan.site_variance else plan
