"""FedNova (Wang et al. 2020; docs/algorithms.md section 8): normalised averaging of unequal local work."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from pydantic import Field

from fedmqtt.strategies.aggregate import combine, copy_weights, sample_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput, SiteUpdate
from fedmqtt.strategies.params import StrategyParams
from fedmqtt.strategies.rule import ServerRule, float_state
from fedmqtt.strategies.strategy_doc import StrategyDoc
from fedmqtt.strategies.sums import NormalisedSums


class FedNovaParams(StrategyParams):
    eta_g: float = Field(default=1.0, gt=0.0, description="server learning rate eta_g, > 0")
    tau_eff: Literal["norm", "steps"] = Field(
        default="norm", description="tau_eff = sum p_i ||a_i||_1 (norm, paper) or sum p_i tau_i (steps, code)"
    )
    gmf: float = Field(
        default=0.0, ge=0.0, lt=1.0, description="server momentum factor (reference code); 0: off"
    )


def a_norm_momentum(steps: int, rho: float) -> float:
    """||a_i||_1 of heavy-ball SGD (PyTorch form, fresh buffer): sum_{s=1..tau} (1 - rho^s)/(1 - rho).

    Args:
        steps: local steps tau_i actually taken.
        rho: momentum factor in [0, 1); 0 is plain SGD (||a_i||_1 = tau_i).
    """
    if rho == 0.0:
        return float(steps)
    return (steps - rho * (1.0 - rho**steps) / (1.0 - rho)) / (1.0 - rho)


def a_norm_proximal(steps: int, lr_mu: float) -> float:
    """||a_i||_1 of SGD with a FedProx term, no momentum: (1 - (1 - eta_l mu)^tau) / (eta_l mu).

    Args:
        steps: local steps tau_i actually taken.
        lr_mu: eta_l * mu; 0 is plain SGD.
    """
    if lr_mu == 0.0:
        return float(steps)
    return (1.0 - (1.0 - lr_mu) ** steps) / lr_mu


class FedNova(ServerRule):
    """FedNova (Wang et al., NeurIPS 2020), on TRAIN tensors (Delta_i = x - y_i):

        x <- x - eta_g tau_eff sum_{i in S_t} p_i Delta_i / ||a_i||_1,   tau_eff = sum_i p_i ||a_i||_1

    Float buffers get p_i and no normalisation; integer buffers the maximum. Optional server momentum
    (`gmf`): buf = gmf buf + update, x <- x - buf, the reference code's rule for a constant eta_l.
    """

    name = "fednova"
    summary = "FedNova: averages updates normalised by local work ||a_i||_1 (Wang et al. 2020)"
    Params = FedNovaParams
    params: FedNovaParams
    uplink_extras = ("a_norm",)
    needs_only_sums = True
    sums_normalised = True
    sums_note = (
        "under secure aggregation each site masks p_i w_i, p_i, p_i w_i / a_i, p_i a_i, p_i tau_i and p_i / a_i "
        "(p_i = n_i / B): sum p_i (w_t - w_i) / a_i = w_t sum p_i / a_i - sum p_i w_i / a_i, and every other "
        "term of the server rule is a sum, divided by sum p_i"
    )

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.momentum: dict[str, np.ndarray] = {}

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        if not inp.updates:
            return AggregateResult(weights=copy_weights(inp.current))
        p = sample_weights(inp.updates)
        norms = [_a_norm(u) for u in inp.updates]
        work = norms if self.params.tau_eff == "norm" else [float(u.local_steps) for u in inp.updates]
        tau_eff = float(sum(w * a for w, a in zip(p, work, strict=True)))
        g = self.groups(inp)
        out = combine(inp.updates, p, g.floatbuf + g.intbuf, inp.current)
        directions: dict[str, np.ndarray] = {}
        for name in g.train:
            x = np.asarray(inp.current[name], dtype=np.float64)
            d = np.zeros(x.shape)
            for w, a, u in zip(p, norms, inp.updates, strict=True):
                if a > 0:  # a site that took no step moved nowhere and contributes nothing
                    d += w * (x - np.asarray(u.tensors[name], dtype=np.float64)) / a
            directions[name] = d
        return self._step(inp, out, directions, tau_eff)

    def aggregate_from_sums(self, inp: RoundInput, mean: Mapping[str, np.ndarray], sums: NormalisedSums,
                            ) -> AggregateResult:
        """The same step from sums alone (secure aggregation, fedmqtt/secagg/weighted.py): with P = sum p_i,
        sum_{a_i > 0} p_i (x - y_i) / a_i = x sum p_i / a_i - sum p_i y_i / a_i, all over P; float buffers are
        the weighted `mean`, integer buffers as `mean` gives them."""
        if not sums.weight > 0:
            raise ValueError(f"the surviving sites' total weight is {sums.weight}: nothing to average")
        g = self.groups(inp)
        out = {name: np.asarray(mean[name]) for name in g.floatbuf + g.intbuf}
        directions = {name: (np.asarray(inp.current[name], dtype=np.float64) * sums.inverse_work
                             - sums.scaled[name]) / sums.weight for name in g.train}
        work = sums.work if self.params.tau_eff == "norm" else sums.steps
        return self._step(inp, out, directions, work / sums.weight)

    def _step(self, inp: RoundInput, out: dict[str, np.ndarray], directions: Mapping[str, np.ndarray],
              tau_eff: float) -> AggregateResult:
        for name, d in directions.items():
            ref = inp.current[name]
            x = np.asarray(ref, dtype=np.float64)
            update = self.params.eta_g * tau_eff * d
            if self.params.gmf > 0:
                update = self.params.gmf * self.momentum.get(name, np.zeros(x.shape)) + update
                self.momentum[name] = update
            out[name] = (x - update).astype(ref.dtype)
        return AggregateResult(weights=self.complete(inp, out))

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": float_state(self.momentum)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.momentum = float_state(state.get("momentum", {}))


def _a_norm(update: SiteUpdate) -> float:
    """||a_i||_1 from the uplink; without it, plain SGD's tau_i (docs/algorithms.md 8, non-SGD reading)."""
    return float(update.extras.get("a_norm", update.local_steps))


ABOUT = StrategyDoc(
    section="8",
    title="FedNova",
    names=("fednova",),
    summary=(
        "Normalised averaging: sites that take more local steps (more data with a fixed number of epochs) "
        "would pull FedAvg towards their own optimum. FedNova divides each site's model change by the amount "
        "of local work it did, ||a_i||_1, averages these normalised changes and rescales the result by the "
        "mean work tau_eff."
    ),
    server="""
Delta_i = x - y_i;   d_i = Delta_i / ||a_i||_1          (a site with ||a_i||_1 = 0 contributes nothing)
tau_eff = sum_{i in S_t} p_i * ||a_i||_1       (tau_eff = steps: sum_{i in S_t} p_i * tau_i)
x <- x - eta_g * tau_eff * sum_{i in S_t} p_i * d_i
optional server momentum gmf > 0:  buf <- gmf * buf + update;  x <- x - buf
TRAIN tensors only; float buffers: p_i-weighted mean; integer buffers: max
""",
    client="""
local SGD for tau_i steps with constant eta_l (momentum rho optional, buffer fresh every round)
||a_i||_1, sent with the update, follows the optimiser actually used:
  plain SGD:               tau_i
  heavy ball rho:          sum_{s=1..tau_i} (1 - rho^s) / (1 - rho)
  Nesterov rho:            sum_{s=1..tau_i} (1 + rho * (1 - rho^s) / (1 - rho))
""",
    state="Server: the momentum buffer when gmf > 0. Sites: none.",
    papers=("Wang, Liu, Liang, Joshi, Poor: Tackling the objective inconsistency problem in heterogeneous "
            "federated optimization, NeurIPS 2020 (arXiv 2007.07481); its authors' code.",),
    differences=(
        "Local momentum (`--hyper momentum=0.9`, the paper's setting) reaches the site's optimiser and "
        "||a_i||_1 is computed from that same setting, so the two cannot disagree. For Nesterov momentum "
        "the project uses the Nesterov form above; the authors' code counts Nesterov steps with the "
        "heavy-ball formula, which understates the local work.",
        "tau_eff = sum p_i ||a_i||_1 (the paper) by default; the authors' code uses sum p_i tau_i when a "
        "proximal term is on: `tau_eff = \"steps\"`.",
        "FedNova needs SGD; another local optimiser is refused up front with the fix in the message (Adam "
        "has no a_i). There is no proximal term in this project's FedNova.",
        "Server momentum `gmf` is applied as buf = gmf * buf + update, x -= buf; the authors' code divides "
        "by and multiplies with eta_l, which is the same for a constant learning rate.",
    ),
    example="""
Toy (0.7), equal n, but site 2 runs 4 steps: y = (0.19, 1.7195), ||a|| = (2, 4), tau_eff = 3,
x = -3 * (0.5 * (-0.19/2) + 0.5 * (-1.7195/4)) = 0.7873125 (FedAvg: 0.95475). Work norms: momentum 0.9 for
3 steps gives 5.61; a proximal factor eta_l * mu = 0.05 for 3 steps gives 2.8525.
""",
)
