"""FedPxN (Hwang et al.; docs/algorithms.md section 4): FedBN plus a proximal term on non-NORM."""

from __future__ import annotations

from collections.abc import Mapping

from fedmqtt.strategies.fedbn import FedBN, FedBNParams
from fedmqtt.strategies.params import mu_field
from fedmqtt.strategies.strategy_doc import StrategyDoc


class FedPxNParams(FedBNParams):
    mu: float = mu_field()


class FedPxN(FedBN):
    """FedPxN (Hwang et al., Algorithm 2): sites minimise F_i(w) + (mu/2)||u - u_t||^2 over the
    non-NORM parameters u only; the server is exactly FedBN's (NORM local, p_i-weighted mean of the rest).
    """

    name = "fedpxn"
    summary = "FedPxN: FedBN plus a proximal term on the non-normalization parameters (Hwang et al.)"
    Params = FedPxNParams
    needs_only_sums = True
    sums_note = (
        "as FedBN: the proximal term is on the sites"
    )
    params: FedPxNParams

    def site_hyper(self, site_id: str, enrolled: Mapping[str, int]) -> dict[str, float]:
        return {"mu": self.params.mu}


ABOUT = StrategyDoc(
    section="4",
    title="FedPxN",
    names=("fedpxn",),
    summary=(
        "FedBN plus a FedProx term restricted to the non-normalization parameters: the normalization layers "
        "adapt freely to the site while the rest of the model is kept near the global one."
    ),
    server="""
exactly FedBN's (section 3); downlink task carries mu
""",
    client="""
u = non-normalization TRAIN parameters, u_t = their received values (anchor)
minimise h_i(w) = F_i(w) + (mu/2) * ||u - u_t||^2      normalization parameters get no proximal gradient
""",
    state="Sites: their normalization tensors, as FedBN. Server: none.",
    papers=("Hwang, Yang, Kim, Dua, Kim, Yang, Choi: Towards the practical utility of federated "
            "learning in the medical domain, CHIL 2023 (arXiv 2207.03075), section 3.4 and Algorithm 2.",),
    differences=(
        "The proximal term excludes normalization parameters, as the paper describes; in the released code "
        "of Hwang et al., the eICU and skin modules compare the algorithm name with a misspelt string and so "
        "apply the term to every parameter. A unit test checks that normalization parameters get exactly "
        "zero proximal gradient here.",
        "Squared norm from the first step of every round, as FedProx (section 2).",
    ),
    example="""
Toy of section 3 with mu = 0.5: u goes 0 -> 0.1 -> 0.185 and 0 -> 0.5 -> 0.925 and averages to 0.555
(FedBN: 0.57); g ends at 1.19 and 0.81, as with FedBN, because it has no proximal term.
""",
)
