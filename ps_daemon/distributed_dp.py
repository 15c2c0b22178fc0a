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
    def strategy_params(self) -> dict[str, float]: ...


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
    if p.target_quantile:
        return ("secure_aggregation.distributed_dp: adaptive clipping (target_quantile > 0) is not available under "
                "distributed DP (its noised count of clipped sites is not summed): use a fixed clip_norm")
    if p.noise_multiplier <= 0:
        return "secure_aggregation.distributed_dp needs noise: noise_multiplier > 0"
    try:
        plan = plan_of(sa, p, n_sites, dim=1)
    except ValueError as exc:
        return str(exc)
    return reach_problem(plan, n_sites, sa.ring_bits)


def plan_of(sa: SecureAggregationView, params: DPFedAvgParams, n_sites: int, dim: int) -> SkellamPlan:
    return SkellamPlan(params.clip_norm, params.noise_multiplier, expected_sites(sa, params, n_sites),
                       sa.fraction_bits, dim)


def terms_of(config: RunView) -> DistributedDPTerms | None:
    """What each train task tells its site about the noise; None without distributed DP."""
    sa = config.secure_aggregation
    if sa.distributed_dp == "off":
        return None
    p = DPFedAvgParams.model_validate(config.strategy_params())
    return DistributedDPTerms(mechanism=sa.distributed_dp, clip=p.clip_norm, noise_multiplier=p.noise_multiplier,
                              expected_sites=expected_sites(sa, p, len(config.sites)))


def aggregate_noised(strategy: Strategy, config: RunView, inp: RoundInput, total: np.ndarray,
                     layout: Layout, included: tuple[str, ...]) -> AggregateResult:
    """DP-FedAvg's step from the unmasked sum: the sites' clipped changes plus their noise (first the float
    tensors in `layout`'s order, then the weight's slot, which carries 0)."""
    if not isinstance(strategy, DPFedAvg):
        raise ValueError(f"distributed DP aggregates with {ALGORITHM}, not {strategy.name}")
    if total.shape != (layout.length,) or layout.variates or layout.normalised:
        raise ValueError(f"the sum has {total.shape} coordinates, the layout {layout.length}")
    plan = plan_of(config.secure_aggregation, strategy.params, len(config.sites), layout.floats)
    change: dict[str, np.ndarray] = {}
    at = 0
    for name, shape in zip(layout.names, layout.shapes, strict=True):
        size = int(np.prod(shape, dtype=np.int64))
        change[name] = total[at:at + size].reshape(shape)
        at += size
    return strategy.aggregate_noised_sum(inp, change, plan, len(included))
