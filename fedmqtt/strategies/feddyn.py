"""FedDyn (Acar et al. 2021; docs/algorithms.md section 6): dynamic regularisation, server drift S_bar."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import Field

from fedmqtt.strategies.aggregate import combine, copy_weights, uniform_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput, SiteUpdate, Weights
from fedmqtt.strategies.params import StrategyParams
from fedmqtt.strategies.rule import ServerRule, float_state
from fedmqtt.strategies.strategy_doc import StrategyDoc

# Acar et al.'s code clips every local gradient at norm 10 (torch.nn.utils.clip_grad_norm_, max_norm=10): the
# gradient of the loss plus FedDyn's linear term, before the quadratic term's weight decay is added.
DEFAULT_MAX_GRAD_NORM = 10.0


class FedDynParams(StrategyParams):
    alpha: float = Field(default=0.01, gt=0.0, description="regularisation strength alpha, > 0")
    scale_alpha_by_size: bool = Field(
        default=True,
        description="alpha_i = alpha * n_bar / n_i (reference code); false: alpha for all (Hwang et al.)",
    )
    max_grad_norm: float = Field(
        default=DEFAULT_MAX_GRAD_NORM, ge=0.0,
        description="sites clip the gradient of the loss plus FedDyn's linear term to this L2 norm before "
                    "the quadratic term's alpha_i * theta is added, as the paper's code does (10); 0: no clipping",
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
    needs_only_sums = True
    sums_uniform = True
    sums_note = (
        "the plain mean of the models (each site weighs its masked vector by 1) and how many sites it holds: "
        "theta_avg is that mean and S_bar moves by their sum, count x (mean - theta_send), over N"
    )
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
            for w, u in zip(share, inp.updates, strict=True):
                theta_i = np.asarray(u.tensors[name], dtype=np.float64)
                drift = drift + inv_n * (theta_i - ref)
                avg += w * theta_i
            self.s_bar[name] = drift
            # theta_send from the float64 average, so float32 models are rounded once
            sent[name] = (avg + drift).astype(inp.current[name].dtype)
            self.theta_avg[name] = plain[name]
        weights = self.complete(inp, sent)
        return AggregateResult(weights=weights, eval_weights=self.complete(inp, plain))

    def aggregate_from_uniform_mean(self, inp: RoundInput, mean: Mapping[str, np.ndarray],
                                    count: int) -> AggregateResult:
        """The same step from the plain mean of the `count` participants' models (secure aggregation): their sum
        sum_i (theta_i - theta_send) is count * (mean - theta_send), and theta_avg is the mean. `mean` holds the
        float tensors (float buffers take it) and the server's integer buffers; N counts the enrolled sites."""
        g = self.groups(inp)
        inv_n = 1.0 / max(len(set(inp.enrolled)), count, 1)
        plain = combine([SiteUpdate("mean", dict(mean), count, 0)], [1.0], g.train + g.floatbuf + g.intbuf,
                        inp.current)
        sent: Weights = dict(plain)
        for name in g.train:
            ref = np.asarray(inp.current[name], dtype=np.float64)
            avg = np.asarray(mean[name], dtype=np.float64)
            drift = self.s_bar.get(name, np.zeros(ref.shape)) + inv_n * count * (avg - ref)
            self.s_bar[name] = drift
            sent[name] = (avg + drift).astype(inp.current[name].dtype)
            self.theta_avg[name] = plain[name]
        return AggregateResult(weights=self.complete(inp, sent), eval_weights=self.complete(inp, plain))

    def state_dict(self) -> dict[str, Any]:
        return {"s_bar": float_state(self.s_bar), "theta_avg": copy_weights(self.theta_avg)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.s_bar = float_state(state.get("s_bar", {}))
        self.theta_avg = copy_weights(state.get("theta_avg", {}))


ABOUT = StrategyDoc(
    section="6",
    title="FedDyn",
    names=("feddyn",),
    summary=(
        "Dynamic regularisation: each site adds a linear and a quadratic term to its loss, built from its "
        "own accumulated drift, so that the sites' local optima line up with the global one. The server "
        "keeps the mean drift S_bar over all enrolled sites, sends theta_send = theta_avg + S_bar, and "
        "evaluates the plain average theta_avg. Written here in model units (the paper stores the same thing "
        "as gradients, g_i = -alpha_i * s_i and h = -alpha * S_bar)."
    ),
    server="""
S_bar      <- S_bar + (1/N) * sum_{i in S_t} (theta_i^t - theta_send)       N = all enrolled sites
theta_avg   = (1/|S_t|) * sum_{i in S_t} theta_i^t                            (unweighted, as the paper)
theta_send <- theta_avg + S_bar                                               (next round's downlink)
TRAIN tensors only; float buffers: plain mean over S_t, no correction; integer buffers: max
the evaluated model is theta_avg; per-site task carries alpha_i and max_grad_norm
alpha_i = alpha * n_bar / n_i  (n_bar = n / N; scale_alpha_by_size = false: alpha_i = alpha)
""",
    client="""
R_i(theta) = F_i(theta) + alpha_i * <theta, s_i> + (alpha_i / 2) * ||theta - theta_send||^2
gradient:    grad F_i(theta) + alpha_i * s_i + alpha_i * (theta - theta_send)      (TRAIN parameters only)
each step, as the authors' code: g = clip(grad F_i(theta) + alpha_i * (s_i - theta_send), max_grad_norm),
             then g + alpha_i * theta goes to the optimiser (the quadratic term is never clipped)
after training: s_i <- s_i + (theta_i^t - theta_send)         (pending until the server accepts, 0.6)
""",
    state=(
        "Sites: the drift s_i (shaped like the trainable tensors), committed only when the server aggregated "
        "the update that produced it. Server: S_bar and theta_avg."
    ),
    papers=("Acar, Zhao, Matas, Mattina, Whatmough, Saligrama: Federated learning based on dynamic "
            "regularization, ICLR 2021 (arXiv 2111.04263), Algorithm 1; its authors' code.",),
    differences=(
        "Local gradients are clipped at L2 norm `max_grad_norm` = 10 by default, in the order of the paper's "
        "code: the gradient of the loss plus the linear term alpha_i * <theta, s_i - theta_send> is clipped, "
        "then alpha_i * theta (their optimiser's weight decay) is added before the step; "
        "`max_grad_norm = 0` turns clipping off.",
        "Both terms are written into the loss and apply to trainable parameters only. Hwang et al.'s code "
        "delegates the quadratic term to the optimiser's weight decay (which Adam rescales and AdamW applies "
        "outside the gradient), anchors the linear term on the previous plain average and corrects every "
        "state entry, BatchNorm running variances included (a route to negative variances and NaN).",
        "alpha_i = alpha * n_bar / n_i by default, as the authors' code (smaller sites get a stronger "
        "regulariser); the paper and Hwang et al. use one alpha: `scale_alpha_by_size = false`.",
        "The plain average theta_avg is what is evaluated and reported, never theta_send.",
    ),
    example="""
Toy (0.7), alpha = 0.1, equal n, N = 2, both sites every round. Round 1: sites 0.189 and 0.945, S_bar = 0.567,
theta_avg = 0.567, theta_send = 1.134. Round 2: sites 1.1051019 and 1.8468135, S_bar = 0.9089577,
theta_avg = 1.4759577, theta_send = 2.3849154. With N = 3 and only sites 1 and 2 in round 1:
S_bar = 0.378, theta_avg = 0.567, theta_send = 0.945.
""",
)
