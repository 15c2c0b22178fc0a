"""FedOpt (Reddi et al. 2021; docs/algorithms.md section 5): FedAdam, FedAdagrad, FedYogi server optimizers."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from pydantic import Field

from fedmqtt.strategies.aggregate import combine, copy_weights, mean_delta, participant_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput
from fedmqtt.strategies.params import WeightingParams
from fedmqtt.strategies.rule import ServerRule, float_state


class FedAdagradParams(WeightingParams):
    eta_g: float = Field(default=0.01, gt=0.0, description="server learning rate eta_g, > 0")
    tau: float = Field(default=1e-3, gt=0.0, description="degree of adaptivity tau (seed 000: gamma), > 0")
    b1: float = Field(default=0.9, ge=0.0, lt=1.0, description="first-moment decay b1, in [0, 1)")
    v_init: float | None = Field(
        default=None,
        ge=0.0,
        description="initial second moment v_0; unset: tau^2 (Reddi et al.); 0: seed 000",
    )


class FedAdamParams(FedAdagradParams):
    b2: float = Field(default=0.99, ge=0.0, lt=1.0, description="second-moment decay b2, in [0, 1)")


class FedOpt(ServerRule):
    """FedOpt (Reddi et al., ICLR 2021, Algorithm 2), without bias correction:

        Delta_t = sum_i p_i (w_i^t - w_t);  m_t = b1 m_{t-1} + (1 - b1) Delta_t;  v_t: per variant;
        w_{t+1} = w_t + eta_g m_t / (sqrt(v_t) + tau)

    on TRAIN tensors only. Float buffers are the p_i-weighted average and integer buffers the maximum:
    running statistics never go through the moments (docs/algorithms.md 5 DECISION).
    """

    Params = FedAdagradParams
    params: FedAdagradParams

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}

    def second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        if not inp.updates:
            return AggregateResult(weights=copy_weights(inp.current))  # m, v untouched (docs/algorithms.md 5)
        p = participant_weights(inp.updates, self.params.weighting)
        g = self.groups(inp)
        out = combine(inp.updates, p, g.floatbuf + g.intbuf, inp.current)
        v0 = self.params.tau**2 if self.params.v_init is None else self.params.v_init
        for name in g.train:
            ref = inp.current[name]
            delta = mean_delta(inp.updates, p, name, inp.current)
            m = self.params.b1 * self.m.get(name, np.zeros(ref.shape)) + (1.0 - self.params.b1) * delta
            v = self.second_moment(self.v.get(name, np.full(ref.shape, v0)), delta * delta)
            self.m[name], self.v[name] = m, v
            step = self.params.eta_g * m / (np.sqrt(v) + self.params.tau)
            out[name] = (np.asarray(ref, dtype=np.float64) + step).astype(ref.dtype)
        return AggregateResult(weights=self.complete(inp, out))

    def state_dict(self) -> dict[str, Any]:
        return {"m": float_state(self.m), "v": float_state(self.v)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m = float_state(state.get("m", {}))
        self.v = float_state(state.get("v", {}))


class FedAdam(FedOpt):
    """FedAdam: v_t = b2 v_{t-1} + (1 - b2) Delta_t^2."""

    name = "fedadam"
    summary = "FedAdam: Adam-style server step on the mean client delta (Reddi et al. 2021)"
    Params = FedAdamParams
    params: FedAdamParams

    def second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        return np.asarray(self.params.b2 * v + (1.0 - self.params.b2) * delta_sq, dtype=np.float64)


class FedAdagrad(FedOpt):
    """FedAdagrad: v_t = v_{t-1} + Delta_t^2."""

    name = "fedadagrad"
    summary = "FedAdagrad: Adagrad-style server step on the mean client delta (Reddi et al. 2021)"

    def second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        return np.asarray(v + delta_sq, dtype=np.float64)


class FedYogi(FedOpt):
    """FedYogi: v_t = v_{t-1} - (1 - b2) Delta_t^2 sign(v_{t-1} - Delta_t^2)."""

    name = "fedyogi"
    summary = "FedYogi: Yogi-style server step on the mean client delta (Reddi et al. 2021)"
    Params = FedAdamParams
    params: FedAdamParams

    def second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        return np.asarray(v - (1.0 - self.params.b2) * delta_sq * np.sign(v - delta_sq), dtype=np.float64)
