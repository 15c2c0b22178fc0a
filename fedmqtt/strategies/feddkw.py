"""FedDkw (Li et al. 2023; docs/algorithms.md section 10): weights inversely proportional to label KL."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import Field

from fedmqtt.strategies.aggregate import copy_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput, SiteUpdate
from fedmqtt.strategies.params import StrategyParams
from fedmqtt.strategies.rule import ServerRule
from fedmqtt.strategies.strategy_doc import StrategyDoc

Histogram = dict[str, float]


class FedDkwParams(StrategyParams):
    kl_floor: float = Field(
        default=1e-6, gt=0.0, description="floor on KL_i before 1/KL (DECISION 1e-6), > 0"
    )
    multiply_by_n: bool = Field(
        default=False, description="weight proportional to n_i / KL_i instead of 1 / KL_i"
    )
    # pooled (default): the label distribution of all the sites' data together, the paper's "global
    # distribution", so a large hospital counts for its patients; also this rule's behaviour so far.
    # mean: the plain mean of the sites' normalised distributions (Milasheuski et al.'s code), every site alike.
    global_distribution: Literal["pooled", "mean"] = Field(
        default="pooled",
        description="P_g: pooled (sum of counts / total, the paper's global distribution) or mean (average "
                    "of the sites' normalised distributions, Milasheuski et al.'s code)",
    )


def as_histogram(raw: object) -> Histogram:
    """Label counts keyed by class name (str): from a mapping, or a sequence indexed by class."""
    if isinstance(raw, Mapping):
        return {str(k): float(v) for k, v in raw.items()}
    return {str(k): float(v) for k, v in enumerate(np.asarray(raw, dtype=np.float64).ravel())}


def pooled_distribution(histograms: Sequence[Histogram]) -> Histogram:
    """P_g = sum_i h_i / total count over every histogram given (the sites reported so far)."""
    counts: Histogram = {}
    for h in histograms:
        for label in sorted(h):
            counts[label] = counts.get(label, 0.0) + h[label]
    total = sum(counts[label] for label in sorted(counts))
    return {label: c / total for label, c in counts.items()} if total > 0 else {}


def mean_distribution(histograms: Sequence[Histogram]) -> Histogram:
    """P_g = (1/K) sum_i h_i / |h_i| over the K non-empty histograms given (each site counts alike)."""
    shares: Histogram = {}
    used = [h for h in histograms if sum(h[label] for label in sorted(h)) > 0]
    for h in used:
        total = sum(h[label] for label in sorted(h))
        for label in sorted(h):
            shares[label] = shares.get(label, 0.0) + h[label] / total / len(used)
    return shares


def kl_divergence(histogram: Histogram, pooled: Histogram) -> float:
    """KL(q_i || P_g) = sum_c q_i(c) ln(q_i(c) / P_g(c)); terms with q_i(c) = 0 are 0."""
    total = sum(histogram[label] for label in sorted(histogram))
    kl = 0.0
    for label in sorted(histogram):
        q = histogram[label] / total
        if q > 0:
            kl += q * math.log(q / pooled[label])
    return kl


class FedDkw(ServerRule):
    """FedDkw (Li et al., ACM TALLIP 2023):

        omega_i = (1 / max(KL_i, floor)) / sum_{j in S_t} (1 / max(KL_j, floor)),  w_{t+1} = sum omega_i w_i^t

    KL_i = KL(q_i || P_g) with P_g from the latest histogram of every site reported so far: pooled counts
    (default) or the mean of the sites' distributions (`global_distribution`).
    Float buffers get omega_i; integer buffers the maximum.
    """

    name = "feddkw"
    summary = (
        "FedDkw: weights 1/KL between each site's label distribution and the pooled one (Li et al. 2023)"
    )
    Params = FedDkwParams
    params: FedDkwParams
    uplink_extras = ("label_histogram",)
    needs_only_sums = False
    sums_note = (
        "the weights come from each site's own label distribution, compared with the others'"
    )

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.histograms: dict[str, Histogram] = {}  # latest h_i of every site that has reported

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        for u in inp.updates:
            if "label_histogram" in u.extras:
                self.histograms[u.site_id] = as_histogram(u.extras["label_histogram"])
        # A site whose histogram the server never got (egress policy) cannot take part
        # (docs/algorithms.md 0.3).
        updates = [u for u in inp.updates if sum(self.histograms.get(u.site_id, {}).values()) > 0]
        if not updates:
            return AggregateResult(weights=copy_weights(inp.current))
        return AggregateResult(weights=self.average(inp, self.weights_of(updates), updates))

    def weights_of(self, updates: Sequence[SiteUpdate]) -> np.ndarray:
        """omega_i for `updates` (all with a stored histogram) against the current pooled distribution."""
        known = [self.histograms[s] for s in sorted(self.histograms)]
        mean = self.params.global_distribution == "mean"
        pooled = mean_distribution(known) if mean else pooled_distribution(known)
        inverse = np.array(
            [
                1.0 / max(kl_divergence(self.histograms[u.site_id], pooled), self.params.kl_floor)
                for u in updates
            ]
        )
        if self.params.multiply_by_n:
            sized = inverse * np.array([u.n_samples for u in updates], dtype=np.float64)
            inverse = sized if sized.sum() > 0 else inverse  # every n_i = 0: 1/KL alone
        return np.asarray(inverse / inverse.sum(), dtype=np.float64)

    def state_dict(self) -> dict[str, Any]:
        return {"histograms": {site: dict(h) for site, h in self.histograms.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.histograms = {str(s): as_histogram(h) for s, h in state.get("histograms", {}).items()}


ABOUT = StrategyDoc(
    section="10",
    title="FedDkw",
    names=("feddkw",),
    summary=(
        "Weights from label distributions: each site sends the label histogram of its training set with its "
        "update; a site whose labels look more like the global distribution (smaller Kullback-Leibler "
        "divergence) gets more weight, 1/KL. The weights are recomputed every round because the participants "
        "and the global distribution change."
    ),
    server="""
h_i = latest label histogram of site i (class counts; 10 length-of-stay bins for regression;
      per-label positive counts for multi-label)
q_i = h_i / sum_c h_i(c)
P_g = pooled: sum_i h_i / total count            (global_distribution = pooled, default)
      mean:   (1/K) * sum_i q_i                  (global_distribution = mean)
      over every site whose histogram the server has received so far
KL_i = sum_c q_i(c) * ln(q_i(c) / P_g(c))          (terms with q_i(c) = 0 are 0)
omega_i = (1 / max(KL_i, kl_floor)) / sum_{j in S_t} (1 / max(KL_j, kl_floor))
          (multiply_by_n = true: n_i / max(KL_i, kl_floor), normalised the same way)
w_{t+1} = sum_{i in S_t} omega_i * w_i^t;  float buffers: omega_i; integer buffers: max
a participant without a histogram is left out of the round
""",
    client="""
as FedAvg, plus the label histogram of its training split in the update (only if its egress policy allows)
""",
    state="Server: the latest histogram of every site that has sent one. Sites: none.",
    papers=("Li et al.: FedDkw: federated learning with dynamic Kullback-Leibler-divergence weight, ACM "
            "Transactions on Asian and Low-Resource Language Information Processing 2023 (the rule follows "
            "its abstract).",
            "Milasheuski et al.: the heterogeneity study that uses it on health data.",),
    differences=(
        "The global distribution P_g is a parameter. The default pools the counts (the paper's global "
        "distribution: a large hospital counts for its patients); Milasheuski et al.'s code averages the sites' "
        "normalised distributions, every site alike: `global_distribution = \"mean\"` reproduces it. With "
        "sites of different sizes the two give different weights.",
        "KL is floored at `kl_floor` = 1e-6 before 1/KL, which the paper leaves undefined for a site that "
        "matches the global distribution exactly.",
        "n_i is not in the weight (weight proportional to 1/KL, per the abstract); `multiply_by_n = true` "
        "adds it.",
    ),
    example="""
Binary labels, h_1 = [8, 2], h_2 = [5, 5], pooled: P_g = [0.65, 0.35], KL = (0.0541883342, 0.0471553397),
omega = (0.4653012654, 0.5346987346).
""",
)
