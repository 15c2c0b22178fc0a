"""FedProx (Li et al. 2020; docs/algorithms.md section 2): FedAvg's server, a proximal term on the sites."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field

from fedmqtt.strategies.fedavg import FedAvg
from fedmqtt.strategies.params import StrategyParams, mu_field
from fedmqtt.strategies.strategy_doc import StrategyDoc


class FedProxParams(StrategyParams):
    mu: float = mu_field()
    prox_skip_first_round: bool = Field(
        default=False, description="Hwang et al.: no proximal term in round 1 (client option, sent as 1.0)"
    )


class FedProx(FedAvg):
    """FedProx (Li et al., MLSys 2020): sites minimise F_i(w) + (mu/2)||w - w_t||^2; server = FedAvg.

    The server only forwards `mu` (and the seed-000 skip flag when set) in every site's task.
    """

    name = "fedprox"
    summary = "FedProx: FedAvg with a proximal term (mu/2)||w - w_t||^2 on the sites (Li et al. 2020)"
    Params = FedProxParams
    needs_only_sums = True
    sums_note = (
        "as FedAvg: the proximal term is on the sites"
    )
    params: FedProxParams

    def site_hyper(self, site_id: str, enrolled: Mapping[str, int]) -> dict[str, float]:
        hyper = {"mu": self.params.mu}
        if self.params.prox_skip_first_round:
            hyper["prox_skip_first_round"] = 1.0  # only sent when on, so the default downlink is just mu
        return hyper


ABOUT = StrategyDoc(
    section="2",
    title="FedProx",
    names=("fedprox",),
    summary=(
        "FedAvg with a proximal term on the sites: each site's local objective gets a penalty on moving away "
        "from the model it received, which limits client drift when the sites' data differ. The server is "
        "FedAvg's; it only adds `mu` to every site's task."
    ),
    server="""
as FedAvg (section 1): w_{t+1} = sum_{i in S_t} p_i * w_i^t; downlink task carries mu
""",
    client="""
anchor w_t = the TRAIN tensors received this round (frozen copy)
minimise h_i(w) = F_i(w) + (mu/2) * ||w - w_t||^2     over TRAIN parameters (buffers excluded)
i.e. every step adds mu * (w - w_t) to the minibatch gradient, at every step of every round
""",
    state="None (as FedAvg).",
    papers=("Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith: Federated optimization in heterogeneous networks, "
            "MLSys 2020 (arXiv 1812.06127).",),
    differences=(
        "The penalty is the squared norm (mu/2)||w - w_t||^2 as in the paper, applied from the first step of "
        "every round. Some published code (Hwang et al.'s, microsoft/PersonalizedFL) uses the unsquared norm or "
        "skips the term in round 1 and on the first batch of every epoch; `prox_skip_first_round = true` "
        "reproduces the round-1 skip only.",
        "The term is written into the gradient explicitly, never delegated to the optimiser's weight decay, "
        "so it means the same with SGD, Adam and AdamW (Adam still rescales it like any other gradient).",
    ),
    example="""
Toy problem (0.7) with mu = 0.5: site 1 goes 0 -> 0.1 -> 0.185, site 2 goes 0 -> 0.5 -> 0.925; with equal n
the server gives 0.555 (FedAvg: 0.57).
""",
)
