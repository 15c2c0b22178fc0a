"""DP-FedAvg with its noise added by the sites under secure aggregation (`[secure_aggregation] distributed_dp`,
fedmqtt/secagg/skellam.py): what the PS checks in the config, tells the sites with each train task, and does with
the unmasked sum. The PS never holds an un-noised sum or any site's change."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, Protocol

import numpy as np

from fedmqtt.secagg.skellam import SkellamPlan, reach_problem
from fedmqtt.secagg.weighted import Layout
from fedmqtt.strategies.base import AggregateResult, RoundInput, Strategy
from fedmqtt.strategies.dp_fedavg import DPFedAvg, DPFedAvgParams
from fedmqtt.strategies.params import HyperValue
from schemas.secagg import DistributedDPTerms


# What this module reads of the PS config (SecureAggregationConfig, DaemonConfig), as protocols: ps_daemon.config
# checks its runs with distributed_dp_problem, so importing the config here would make the two import each other.
class SecureAggregationView(Protocol):
    @property
    def dropout(self) -> float: ...
    @property
    def fraction_bits(self) -> int: ...
    @property
    def ring_bits(self) -> Literal[32, 64]: ...
    @property
    def distributed_dp(self) -> Literal["off", "skellam"]: ...


class RunView(Protocol):
    @property
    def secure_aggregation(self) -> SecureAggregationView: ...
    @property
    def sites(self) -> tuple[str, ...]: ...
    def strategy_params(self) -> dict[str, HyperValue]: ...


ALGORITHM = "dp-fedavg"


def expected_sites(sa: SecureAggregationView, params: DPFedAvgParams, n_sites: int) -> int:
    """The sites the noise is calibrated for: DP-FedAvg's m (every configured site by default) less the fraction
    the secure aggregation round is built to lose, at least 1."""
    m = params.sites_per_round or float(n_sites)
    return max(1, math.ceil((1.0 - sa.dropout) * min(m, n_sites) - 1e-9))


def distributed_dp_problem(algorithm: str, sa: SecureAggregationView, n_sites: int,
                           params: Mapping[str, Any] | None) -> str | None:
    """Why this run cannot use distributed DP (None when it can): another rule than DP-FedAvg, adaptive clipping
    (its noised count is not summed yet), no noise, or a ring too small for the sum and its noise (checked here for
    a one-coordinate model; each site checks again with the model's real size)."""
    if algorithm != ALGORITHM:
        return (f"secure_aggregation.distributed_dp is DP-FedAvg's noise added by the sites: set algorithm = "
                f"\"{ALGORITHM}\" (not {algorithm!r})")
    p = DPFedAvgParams.model_validate(dict(params or {}))
    if p.target_quantile and sa.fraction_bits < 1:
        return ("secure_aggregation.distributed_dp with adaptive clipping needs fraction_bits >= 1 (each site's "
                "clipped-count entry b - 1/2 is a whole number of ring units only then)")
    if p.noise_multiplier <= 0:
        return "secure_aggregation.distributed_dp needs noise: noise_multiplier > 0"
    try:
        plan = plan_of(sa, p, n_sites, dim=1)
    except ValueError as exc:
        return str(exc)
    return reach_problem(plan, n_sites, sa.ring_bits)


def plan_of(sa: SecureAggregationView, params: DPFedAvgParams, n_sites: int, dim: int,
            clip: float | None = None) -> SkellamPlan:
    """The round's noise: at clip `clip` (adaptive clipping's current C; unset: clip_norm). With adaptive clipping
    (Andrew et al.) the change's multiplier is z_D and the clipped count's noise sigma_b, as in the clear form
    (fedmqtt/strategies/dp_fedavg.py), so the two releases together amount to one Gaussian of multiplier z."""
    rule = DPFedAvg(params.model_dump())
    m = rule.denominator({f"s{i}": 0 for i in range(n_sites)})
    count = rule.count_stddev(m) if params.target_quantile else 0.0
    return SkellamPlan(clip or params.clip_norm, rule.change_noise_multiplier(m), expected_sites(sa, params, n_sites),
                       sa.fraction_bits, dim, count)


def terms_of(config: RunView, clip: float | None = None) -> DistributedDPTerms | None:
    """What each train task tells its site about the noise (at adaptive clipping's current `clip`); None without
    distributed DP."""
    sa = config.secure_aggregation
    if sa.distributed_dp == "off":
        return None
    p = DPFedAvgParams.model_validate(config.strategy_params())
    plan = plan_of(sa, p, len(config.sites), dim=1, clip=clip)
    return DistributedDPTerms(mechanism=sa.distributed_dp, clip=plan.clip, noise_multiplier=plan.noise_multiplier,
                              expected_sites=plan.expected_sites, count_stddev=plan.count_stddev)


def aggregate_noised(strategy: Strategy, config: RunView, inp: RoundInput, total: np.ndarray,
                     layout: Layout, included: tuple[str, ...]) -> AggregateResult:
    """DP-FedAvg's step from the unmasked sum: the sites' clipped changes plus their noise (first the float
    tensors in `layout`'s order, then the weight's slot, which carries 0, or with adaptive clipping the noised
    sum of the sites' clipped-count entries b - 1/2)."""
    if not isinstance(strategy, DPFedAvg):
        raise ValueError(f"distributed DP aggregates with {ALGORITHM}, not {strategy.name}")
    if total.shape != (layout.length,) or layout.variates or layout.normalised:
        raise ValueError(f"the sum has {total.shape} coordinates, the layout {layout.length}")
    plan = plan_of(config.secure_aggregation, strategy.params, len(config.sites), layout.floats, clip=strategy.clip)
    change: dict[str, np.ndarray] = {}
    at = 0
    for name, shape in zip(layout.names, layout.shapes, strict=True):
        size = int(np.prod(shape, dtype=np.int64))
        change[name] = total[at:at + size].reshape(shape)
        at += size
    # adaptive clipping: the last slot is the sum of the sites' b - 1/2 and its noise
    count = float(total[at]) + len(included) / 2.0 if plan.count_stddev else None
    return strategy.aggregate_noised_sum(inp, change, plan, len(included), count)
