"""FedPxN (Hwang et al., seed 000; docs/algorithms.md section 4): FedBN plus a proximal term on non-NORM."""

from __future__ import annotations

from typing import Mapping

from fedmqtt.strategies.fedbn import FedBN, FedBNParams
from fedmqtt.strategies.params import mu_field


class FedPxNParams(FedBNParams):
    mu: float = mu_field()


class FedPxN(FedBN):
    """FedPxN (Hwang et al., seed 000 Algorithm 2): sites minimise F_i(w) + (mu/2)||u - u_t||^2 over the
    non-NORM parameters u only; the server is exactly FedBN's (NORM local, p_i-weighted mean of the rest).
    """

    name = "fedpxn"
    summary = "FedPxN: FedBN plus a proximal term on the non-normalization parameters (Hwang et al.)"
    Params = FedPxNParams
    params: FedPxNParams

    def site_hyper(self, site_id: str, enrolled: Mapping[str, int]) -> dict[str, float]:
        return {"mu": self.params.mu}
