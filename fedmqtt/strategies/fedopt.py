"""FedOpt (Reddi et al. 2021; docs/algorithms.md section 5): FedAdam, FedAdagrad, FedYogi on the server."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import Field

from fedmqtt.strategies.aggregate import combine, copy_weights, mean_delta, participant_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput
from fedmqtt.strategies.params import WeightingParams
from fedmqtt.strategies.rule import ServerRule, float_state
from fedmqtt.strategies.strategy_doc import StrategyDoc


class FedAdagradParams(WeightingParams):
    eta_g: float = Field(default=0.01, gt=0.0, description="server learning rate eta_g, > 0")
    tau: float = Field(default=1e-3, gt=0.0, description="degree of adaptivity tau (Hwang et al.: gamma), > 0")
    b1: float = Field(default=0.9, ge=0.0, lt=1.0, description="first-moment decay b1, in [0, 1)")
    v_init: float | None = Field(
        default=None,
        ge=0.0,
        description="initial second moment v_0; unset: tau^2 (Reddi et al.); 0: Hwang et al.",
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
    needs_only_sums = True
    from_weighted_mean = True
    sums_note = (
        "the server step needs only the mean client delta, a weighted sum: under secure aggregation the PS "
        "takes it as the unmasked sample-weighted mean minus the current model (weighting = \"samples\"; "
        "\"uniform\" is refused there)"
    )
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


ABOUT = StrategyDoc(
    section="5",
    title="FedOpt: FedAdam, FedAdagrad, FedYogi",
    names=("fedadam", "fedadagrad", "fedyogi"),
    summary=(
        "Adaptive server optimisers: the weighted mean of the sites' model changes is treated as a "
        "pseudo-gradient and fed to an Adam-, Adagrad- or Yogi-style step on the server. Sites train as in "
        "FedAvg. Only trainable tensors go through the moments; running statistics are averaged plainly."
    ),
    server="""
Delta_t = sum_{i in S_t} p_i * (w_i^t - w_t)                (pseudo-gradient; TRAIN tensors only)
m_t     = b1 * m_{t-1} + (1 - b1) * Delta_t                 m_0 = 0
FedAdam:    v_t = b2 * v_{t-1} + (1 - b2) * Delta_t^2
FedAdagrad: v_t = v_{t-1} + Delta_t^2
FedYogi:    v_t = v_{t-1} - (1 - b2) * Delta_t^2 * sign(v_{t-1} - Delta_t^2)
                                                            v_0 = tau^2 (or v_init)
w_{t+1} = w_t + eta_g * m_t / (sqrt(v_t) + tau)             no bias correction
float buffers: p_i-weighted mean (never through m, v); integer buffers: max
nobody reported: w, m and v unchanged
""",
    client="""
as FedAvg: plain local loss, local optimiser; send w_i^t, n_i, tau_i
""",
    state="Server: m and v, one float64 value per trainable element, checkpointed with the model. Sites: "
          "none.",
    papers=("Reddi, Charles, Zaheer, Garrett, Rush, Konecny, Kumar, McMahan: Adaptive federated "
            "optimization, ICLR 2021 (arXiv 2003.00295), Algorithm 2.",
            "Hwang et al., appendix A.2: the settings used on medical data.",),
    differences=(
        "No bias correction, as Reddi et al.'s Algorithm 2. Recent Flower versions scale FedAdam's eta by "
        "Adam's bias-correction factor sqrt(1 - b2^k) / (1 - b1^k), with k growing with the round (older "
        "versions did not), so their steps differ from ours by that factor in the first rounds and the two "
        "agree as k grows; there is no setting here that adds it.",
        "FedAdagrad keeps first-moment momentum b1 (default 0.9), as in Reddi et al.'s algorithm; Flower's "
        "FedAdagrad fixes b1 = 0 (m_t = Delta_t). `b1 = 0` reproduces Flower's rule.",
        "v_0 = tau^2, the paper's requirement v_0 >= tau^2; Hwang et al. and Flower start from v_0 = 0: "
        "`v_init = 0` reproduces them (the difference shows only on coordinates with tiny updates).",
        "Sample-weighted pseudo-gradient (Hwang et al.); Reddi et al. use the plain mean: "
        "`weighting = \"uniform\"`.",
        "BatchNorm running statistics are averaged with p_i and never pushed through the moments: Hwang et al. "
        "(and frameworks that treat every array alike) move them with the adaptive step, which can drive a "
        "running variance negative.",
    ),
    example="""
w_t = [0, 0], site models [1, 2] and [3, -2] with equal n: Delta = [2, 0], m = [0.2, 0]; b1 = 0.9,
b2 = 0.99, eta_g = 0.01, tau = 0.001. With v_0 = tau^2: FedAdam v = [0.04000099, 9.9e-7],
w = [0.0099501262, 0]; FedAdagrad v = [4.000001, 1e-6], w = [0.0009995001, 0]; FedYogi v = [0.040001, 1e-6],
w = [0.0099501250, 0]. With v_0 = 0: w = [0.0099502488, 0] for FedAdam and FedYogi, [0.0009995002, 0] for
FedAdagrad. A BN running_mean of 1.0 and 3.0 becomes 2.0.
""",
)
