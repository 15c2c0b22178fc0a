"""FedDyn (Acar et al. 2021; docs/algorithms.md section 6): dynamic regularisation with a server drift S_bar."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from pydantic import Field

from fedmqtt.strategies.aggregate import combine, copy_weights, uniform_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput, Weights
from fedmqtt.strategies.params import StrategyParams
from fedmqtt.strategies.rule import ServerRule, float_state


# Acar et al.'s code clips every local gradient at norm 10 (torch.nn.utils.clip_grad_norm_, max_norm=10).
DEFAULT_MAX_GRAD_NORM = 10.0


class FedDynParams(StrategyParams):
    alpha: float = Field(default=0.01, gt=0.0, description="regularisation strength alpha, > 0")
    scale_alpha_by_size: bool = Field(
        default=True,
        description="alpha_i = alpha * n_bar / n_i (reference code); false: alpha for all (seed 000)",
    )
    max_grad_norm: float = Field(
        default=DEFAULT_MAX_GRAD_NORM, ge=0.0,
        description="sites clip the local gradient (loss + FedDyn terms) to this L2 norm, as the paper's code "
                    "does (10); 0: no clipping",
    )


class FedDyn(ServerRule):
    """FedDyn (Acar et al., ICLR 2021, Algorithm 1), in model units (TRAIN tensors only):

        S_bar      <- S_bar + (1/N) sum_{i in S_t} (theta_i - theta_send)
        theta_avg   = (1/|S_t|) sum_{i in S_t} theta_i
        theta_send <- theta_avg + S_bar

    `weights` is theta_send (the next downlink); `eval_weights` is theta_avg (what is evaluated).
    Float buffers: plain mean over S_t, no correction; integer buffers: maximum.
    """

    name = "feddyn"
    summary = (
        "FedDyn: dynamic regulariser, server drift S_bar; evaluates the plain average (Acar et al. 2021)"
    )
    Params = FedDynParams
    params: FedDynParams

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.s_bar: dict[str, np.ndarray] = {}  # float64, (1/N) sum of every site's s_i
        self.theta_avg: Weights = {}  # last plain average (TRAIN), the evaluated model

    def site_hyper(self, site_id: str, enrolled: Mapping[str, int]) -> dict[str, float]:
        alpha = self.params.alpha
        clip = {"max_grad_norm": self.params.max_grad_norm}
        n_i = enrolled.get(site_id, 0)
        if not self.params.scale_alpha_by_size or n_i <= 0 or not enrolled:
            return {"alpha": alpha, **clip}
        n_bar = sum(enrolled[s] for s in sorted(enrolled)) / len(enrolled)
        return {"alpha": alpha * n_bar / n_i, **clip}  # smaller sites get a stronger regulariser

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        if not inp.updates:
            weights = copy_weights(inp.current)
            return AggregateResult(weights=weights, eval_weights={**weights, **copy_weights(self.theta_avg)})
        g = self.groups(inp)
        sites = set(inp.enrolled) | {u.site_id for u in inp.updates}
        inv_n = 1.0 / len(sites)
        share = uniform_weights(len(inp.updates))
        plain = combine(inp.updates, share, g.train + g.floatbuf + g.intbuf, inp.current)
        sent: Weights = dict(plain)
        for name in g.train:
            ref = np.asarray(inp.current[name], dtype=np.float64)
            drift = self.s_bar.get(name, np.zeros(ref.shape))
            avg = np.zeros(ref.shape)
            for w, u in zip(share, inp.updates):
                theta_i = np.asarray(u.tensors[name], dtype=np.float64)
                drift = drift + inv_n * (theta_i - ref)
                avg += w * theta_i
            self.s_bar[name] = drift
            # theta_send from the float64 average, so float32 models are rounded once
            sent[name] = (avg + drift).astype(inp.current[name].dtype)
            self.theta_avg[name] = plain[name]
        weights = self.complete(inp, sent)
        return AggregateResult(weights=weights, eval_weights=self.complete(inp, plain))

    def state_dict(self) -> dict[str, Any]:
        return {"s_bar": float_state(self.s_bar), "theta_avg": copy_weights(self.theta_avg)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.s_bar = float_state(state.get("s_bar", {}))
        self.theta_avg = copy_weights(state.get("theta_avg", {}))
