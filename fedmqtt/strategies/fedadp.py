"""FedAdp (Wu and Wang 2021; docs/algorithms.md section 9): weights from the angle to the mean update."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import Field

from fedmqtt.strategies.aggregate import Coefficients, copy_weights, sample_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput
from fedmqtt.strategies.params import StrategyParams
from fedmqtt.strategies.rule import ServerRule
from fedmqtt.strategies.strategy_doc import StrategyDoc


class FedAdpParams(StrategyParams):
    a: float = Field(default=5.0, gt=0.0, description="Gompertz constant a (paper: 5), > 0")


def gompertz(theta: float, a: float = 5.0) -> float:
    """f(theta) = a (1 - exp(-exp(-a (theta - 1)))): f(0) = 5, f(1) = 3.1606027941, f(pi/2) = 0.2799308564."""
    return a * (1.0 - math.exp(-math.exp(-a * (theta - 1.0))))


def update_angles(directions: Sequence[np.ndarray], weights: Coefficients) -> np.ndarray:
    """theta_i = arccos(<g, g_i> / (||g|| ||g_i||)) in radians, g = sum_i weights_i g_i.

    A zero vector has no direction: its angle is pi/2 (docs/algorithms.md 9 DECISION; Plato's 0 would give
    it the largest weight).
    """
    g = np.zeros_like(directions[0]) if directions else np.zeros(0)
    for w, gi in zip(weights, directions, strict=True):
        g = g + float(w) * gi
    g_norm = float(np.linalg.norm(g))
    angles = []
    for gi in directions:
        gi_norm = float(np.linalg.norm(gi))
        if g_norm == 0.0 or gi_norm == 0.0:
            angles.append(math.pi / 2)
        else:
            angles.append(math.acos(min(1.0, max(-1.0, float(np.dot(g, gi)) / (g_norm * gi_norm)))))
    return np.array(angles)


class FedAdp(ServerRule):
    """FedAdp (Wu and Wang, IEEE TCCN 2021): with g_i = w_t - w_i^t over the flattened TRAIN tensors,

        theta_bar_i = running mean of client i's angles theta_i over its own participations t_i
        psi_i = n_i exp(f(theta_bar_i)) / sum_{j in S_t} n_j exp(f(theta_bar_j));  w_{t+1} = sum psi_i w_i^t

    Float buffers get psi_i (but stay out of the angle); integer buffers the maximum.
    """

    name = "fedadp"
    summary = (
        "FedAdp: weights from the smoothed angle between each update and the mean one (Wu and Wang 2021)"
    )
    Params = FedAdpParams
    needs_only_sums = False
    sums_note = (
        "the weights come from the angle between each site's own update and the mean update: the PS must see "
        "every site's update"
    )
    params: FedAdpParams

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.theta_bar: dict[str, float] = {}
        self.count: dict[str, int] = {}  # participations of each site (docs/algorithms.md 9 DECISION)

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        if not inp.updates:
            return AggregateResult(weights=copy_weights(inp.current))
        train = sorted(self.groups(inp).train)
        flat_current = _flatten(inp.current, train)
        directions = [flat_current - _flatten(u.tensors, train) for u in inp.updates]
        angles = update_angles(directions, sample_weights(inp.updates))
        for u, theta in zip(inp.updates, angles, strict=True):
            t = self.count.get(u.site_id, 0) + 1
            prev = self.theta_bar.get(u.site_id, 0.0)
            self.theta_bar[u.site_id] = float(theta) if t == 1 else ((t - 1) / t) * prev + float(theta) / t
            self.count[u.site_id] = t
        return AggregateResult(weights=self.average(inp, self.weights_of(inp)))

    def weights_of(self, inp: RoundInput) -> np.ndarray:
        """psi_i of this round's participants from their current theta_bar_i."""
        scores = np.array([math.exp(gompertz(self.theta_bar[u.site_id], self.params.a)) for u in inp.updates])
        sized = np.array([u.n_samples for u in inp.updates], dtype=np.float64) * scores
        # every n_i = 0 would divide by zero: fall back to the angle term alone
        sized = sized if sized.sum() > 0 else scores
        return np.asarray(sized / sized.sum(), dtype=np.float64)

    def state_dict(self) -> dict[str, Any]:
        return {"theta_bar": dict(self.theta_bar), "count": dict(self.count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.theta_bar = {str(k): float(v) for k, v in state.get("theta_bar", {}).items()}
        self.count = {str(k): int(v) for k, v in state.get("count", {}).items()}


def _flatten(tensors: Mapping[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    if not names:
        return np.zeros(0)
    return np.concatenate([np.asarray(tensors[n], dtype=np.float64).ravel() for n in names])


ABOUT = StrategyDoc(
    section="9",
    title="FedAdp",
    names=("fedadp",),
    summary=(
        "Adaptive weighting by direction: sites whose update points the same way as the mean update get more "
        "weight. The angle between each site's update and the weighted mean one is smoothed over the site's "
        "participations and mapped through a Gompertz curve; weights are proportional to n_i * "
        "exp(f(angle)). Server-only: sites train as in FedAvg."
    ),
    server="""
g_i = w_t - w_i^t  (flattened TRAIN tensors);   g = sum_{i in S_t} p_i * g_i
theta_i = arccos(clip(<g, g_i> / (||g|| * ||g_i||), -1, 1))        theta_i = pi/2 if ||g|| or ||g_i|| is 0
t_i <- t_i + 1;   theta_bar_i = theta_i (t_i = 1), else ((t_i - 1) * theta_bar_i + theta_i) / t_i
f(theta) = a * (1 - exp(-exp(-a * (theta - 1))))
psi_i = n_i * exp(f(theta_bar_i)) / sum_{j in S_t} n_j * exp(f(theta_bar_j))
w_{t+1} = sum_{i in S_t} psi_i * w_i^t;   float buffers: psi_i (never in the angle); integer buffers: max
""",
    client="""
as FedAvg: plain local loss, local optimiser; send w_i^t, n_i
""",
    state="Server: for every site its smoothed angle theta_bar_i and its participation count t_i. Sites: "
          "none.",
    papers=("Wu, Wang: Fast-convergent federated learning with adaptive weighting, IEEE Transactions on "
            "Cognitive Communications and Networking 2021 (arXiv 2012.00661).",),
    differences=(
        "t_i counts the rounds in which site i took part, so theta_bar_i is the mean of its own angles; the "
        "Plato re-implementation uses the global round index. The two agree under full participation.",
        "An update (or mean update) of norm 0 has angle pi/2; Plato uses 0, which would hand such a site the "
        "largest weight.",
    ),
    example="""
w_t = [0, 0], g_1 = [1, 0], g_2 = [0, 1], n = (1, 3): g = [0.25, 0.75], theta = (1.2490457724, 0.3217505544),
psi = (0.0077838584, 0.9922161416), w = [-0.0077838584, -0.9922161416] (FedAvg: [-0.25, -0.75]). Second
participation with angles 0.5 and 1.0: theta_bar = (0.8745228862, 0.6608752772).
""",
)
