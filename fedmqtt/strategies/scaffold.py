"""SCAFFOLD (Karimireddy et al. 2020; docs/algorithms.md section 7): server side with control variates."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

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
