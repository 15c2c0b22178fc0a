"""FedProx (Li et al. 2020; docs/algorithms.md section 2): FedAvg's server, a proximal term on the sites."""

from __future__ import annotations

from typing import Mapping

from pydantic import Field

from fedmqtt.strategies.fedavg import FedAvg
from fedmqtt.strategies.params import StrategyParams, mu_field


class FedProxParams(StrategyParams):
    mu: float = mu_field()
    prox_skip_first_round: bool = Field(
        default=False, description="seed 000: no proximal term in round 1 (client option, sent as 1.0)"
    )


class FedProx(FedAvg):
    """FedProx (Li et al., MLSys 2020): sites minimise F_i(w) + (mu/2)||w - w_t||^2; server = FedAvg.

    The server only forwards `mu` (and the seed-000 skip flag when set) in every site's task.
    """

    name = "fedprox"
    summary = "FedProx: FedAvg with a proximal term (mu/2)||w - w_t||^2 on the sites (Li et al. 2020)"
    Params = FedProxParams
    params: FedProxParams

    def site_hyper(self, site_id: str, enrolled: Mapping[str, int]) -> dict[str, float]:
        hyper = {"mu": self.params.mu}
        if self.params.prox_skip_first_round:
            hyper["prox_skip_first_round"] = 1.0  # only sent when on, so the default downlink is just mu
        return hyper
