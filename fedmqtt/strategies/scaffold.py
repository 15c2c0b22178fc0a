"""SCAFFOLD (Karimireddy et al. 2020; docs/algorithms.md section 7): server side with control variates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import Field

from fedmqtt.strategies.aggregate import (
    combine,
    copy_weights,
    mean_delta,
    participant_weights,
    population_weights,
    require_extra,
)
from fedmqtt.strategies.base import AggregateResult, RoundInput, SiteUpdate, Weights
from fedmqtt.strategies.params import WeightingParams
from fedmqtt.strategies.rule import ServerRule, float_state
from fedmqtt.strategies.strategy_doc import StrategyDoc


class ScaffoldParams(WeightingParams):
    eta_g: float = Field(default=1.0, gt=0.0, description="server learning rate eta_g, > 0 (paper: 1)")


class Scaffold(ServerRule):
    """SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1, option II on the sites):

        x <- x + eta_g sum_{i in S_t} p_i (y_i - x);   c <- c + sum_{i in S_t} pi_i Delta_c_i

    with p_i renormalised over S_t and pi_i = n_i / n over every enrolled site, which keeps
    c = sum_{all i} pi_i c_i (docs/algorithms.md 7 DECISION; `weighting = uniform`: 1/|S_t| and 1/N, the
    paper). TRAIN tensors only; float buffers get p_i, integer buffers the maximum. Every result
    carries extras {"c": c} for the downlink.
    """

    name = "scaffold"
    summary = "SCAFFOLD: control variates correct client drift (Karimireddy et al. 2020, option II)"
    Params = ScaffoldParams
    params: ScaffoldParams
    uplink_extras = ("delta_c",)
    needs_only_sums = True
    from_weighted_mean = True
    sums_variates = True
    sums_note = (
        "the weighted mean of the models and the sum of the control-variate deltas delta_c: under secure "
        "aggregation each site appends p_i delta_c_i to its masked vector and the PS moves c by B times that "
        "part of the sum over n (weighting = \"samples\"; \"uniform\" is refused there)"
    )

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.c: dict[str, np.ndarray] = {}  # float64 server control variate per TRAIN tensor

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        g = self.groups(inp)
        if not inp.updates:
            return AggregateResult(
                weights=copy_weights(inp.current), extras={"c": self._c_for(inp.current, g.train)}
            )
        p = participant_weights(inp.updates, self.params.weighting)
        pi = population_weights(inp.enrolled, inp.updates, self.params.weighting)
        out = combine(inp.updates, p, g.floatbuf + g.intbuf, inp.current)
        for name in g.train:
            ref = inp.current[name]
            step = self.params.eta_g * mean_delta(inp.updates, p, name, inp.current)
            out[name] = (np.asarray(ref, dtype=np.float64) + step).astype(ref.dtype)
            acc = self.c.get(name, np.zeros(ref.shape))
            for u in inp.updates:
                acc = acc + pi[u.site_id] * _delta_c(u, name)
            self.c[name] = acc
        return AggregateResult(
            weights=self.complete(inp, out), extras={"c": self._c_for(inp.current, g.train)}
        )

    def _c_for(self, current: Weights, train: Sequence[str]) -> Weights:
        """c for every TRAIN tensor (0 before any update), in the dtype of the tensor it corrects."""
        return {
            name: self.c.get(name, np.zeros(current[name].shape)).astype(current[name].dtype)
            for name in train
        }

    def state_dict(self) -> dict[str, Any]:
        return {"c": float_state(self.c)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.c = float_state(state.get("c", {}))


def _delta_c(update: SiteUpdate, name: str) -> np.ndarray:
    """Delta_c_i for one tensor; a missing one would silently break c = sum pi_i c_i, so it is an error."""
    delta_c = require_extra(update, "delta_c", "scaffold")
    if not isinstance(delta_c, Mapping) or name not in delta_c:
        raise ValueError(f"scaffold: extras['delta_c'] from {update.site_id!r} lacks tensor {name!r}")
    return np.asarray(delta_c[name], dtype=np.float64)


ABOUT = StrategyDoc(
    section="7",
    title="SCAFFOLD",
    names=("scaffold",),
    summary=(
        "Control variates correct client drift: the server keeps c, an estimate of the average gradient, and "
        "each site keeps c_i, an estimate of its own; every local step is corrected by (c - c_i), so sites "
        "move towards the global optimum rather than their own. Sites use option II of the paper (c_i from "
        "the model change). Doubles the traffic (c travels down, Delta_c_i up)."
    ),
    server="""
x <- x + eta_g * sum_{i in S_t} p_i * (y_i - x)              p_i over the sites that reported
c <- c + sum_{i in S_t} pi_i * Delta_c_i                     pi_i = n_i / n over ALL enrolled sites
keeps c = sum_{all i} pi_i * c_i at all times; weighting = uniform: p_i = 1/|S_t|, pi_i = 1/N (the paper)
TRAIN tensors only; float buffers: p_i-weighted mean; integer buffers: max
c goes to every site with the global model
""",
    client="""
y <- x; each of the K_i steps:  y <- y - eta_l * (g(y) - c_i + c)        (plain SGD, no momentum)
option II:  c_i_new = c_i - c + (x - y) / (K_i * eta_l)       K_i = steps really taken
send y_i and Delta_c_i = c_i_new - c_i; keep c_i_new pending until the server accepts the update (0.6)
""",
    state="Sites: c_i (committed only when aggregated). Server: c, and every enrolled site's n_i.",
    papers=("Karimireddy, Kale, Mohri, Reddi, Stich, Suresh: SCAFFOLD: stochastic controlled averaging for "
            "federated learning, ICML 2020 (arXiv 1910.06378), Algorithm 1, option II.",),
    differences=(
        "Under partial participation c moves by sum_{i in S_t} pi_i * Delta_c_i with pi_i taken over every "
        "enrolled site (the paper's (|S_t|/N) * mean(Delta_c) when uniform). Implementations that add the "
        "plain mean of the participants' Delta_c agree with this only when every site takes part; with "
        "sampling they move c N/|S_t| times too far and c stops being the mean of the c_i.",
        "Sample-weighted by default (pi_i = n_i / n); `weighting = \"uniform\"` is the paper's 1/N. The "
        "FedDyn authors' SCAFFOLD code also weights by size but rescales the local correction; not "
        "reproduced.",
        "SGD without momentum is required (option II estimates the mean gradient only for plain SGD); a run "
        "configured otherwise is refused up front with the fix in the message.",
        "A site's new c_i is committed only when the server reports that it aggregated the update (0.6), so "
        "a lost or late update never breaks c = sum pi_i c_i.",
    ),
    example="""
Toy (0.7), uniform weights, N = 2, eta_g = 1, K = 2. Round 1: y = 0.19 and 0.95, x = 0.57, c_1 = -0.95,
c_2 = -4.75, c = -2.85. Round 3: y = 1.404727 and 1.406627, x = 1.405677, c = -1.869885: both sites now
head for the global optimum 3. With N = 3 and only sites 1 and 2 in round 1: x = 0.57, c = -1.9.
""",
)
