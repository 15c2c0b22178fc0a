"""AdaFed, d-AdaFed, f-AdaFed (Chen et al. 2022; docs/algorithms.md 11): per-site mixes by similarity."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from pydantic import AliasChoices, Field, field_validator

from fedmqtt.strategies.aggregate import combine, copy_weights, sample_weights, uniform_weights
from fedmqtt.strategies.base import (
    NO_REQUIREMENTS,
    AggregateResult,
    FeatureStatistics,
    LayerStats,
    RoundInput,
    RoundRequirements,
    TensorSpec,
    Weights,
)
from fedmqtt.strategies.params import NormFamily, StrategyParams, expand_norm_types
from fedmqtt.strategies.rule import ServerRule, keeps_norm_local
from fedmqtt.strategies.strategy_doc import StrategyDoc, Subsection


class AdaFedParams(StrategyParams):
    lam: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        validation_alias=AliasChoices("lam", "lambda"),
        description="self weight lambda = W_ii, in (0, 1] (paper: 0.5)",
    )
    norm_types: tuple[NormFamily, ...] = Field(
        default=("batchnorm",),
        description="normalization layers kept local (docs/algorithms.md 11.2: BatchNorm)",
    )
    _expand = field_validator("norm_types", mode="before")(expand_norm_types)


class FAdaFedParams(AdaFedParams):
    warmup_rounds: int | None = Field(
        default=None,
        ge=0,
        description="FedBN rounds before AdaFed; unset: floor(total_rounds / 2) (DECISION)",
    )
    total_rounds: int = Field(default=20, ge=1, description="rounds T of the run, for the default warm-up")


def feature_statistics(features: np.ndarray, channel_axis: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and population variance over every non-channel position (N, H, W / N, L / N).

    Args:
        features: the tensor entering a BN layer (or the penultimate features for d-AdaFed).
        channel_axis: the channel axis (1 in PyTorch layouts).
    """
    x = np.moveaxis(np.asarray(features, dtype=np.float64), channel_axis, 0)
    x = x.reshape(x.shape[0], -1)
    return x.mean(axis=1), x.var(axis=1)


def distance_matrix(stats: Mapping[str, LayerStats]) -> tuple[list[str], np.ndarray]:
    """d_ij = sum_l sqrt(||mu_i^l - mu_j^l||^2 + ||sqrt(r_i^l) - sqrt(r_j^l)||^2), sites sorted by id."""
    sites = sorted(stats)
    layers = sorted(stats[sites[0]]) if sites else []
    for site in sites:
        if sorted(stats[site]) != layers:
            raise ValueError(
                f"adafed: site {site!r} has statistics for layers {sorted(stats[site])}, not {layers}"
            )
    d = np.zeros((len(sites), len(sites)))
    for i, a in enumerate(sites):
        for j, b in enumerate(sites[:i]):
            total = 0.0
            for layer in layers:
                (mu_a, r_a), (mu_b, r_b) = stats[a][layer], stats[b][layer]
                dmu = np.asarray(mu_a, dtype=np.float64) - np.asarray(mu_b, dtype=np.float64)
                dsd = _std(r_a) - _std(r_b)
                total += math.sqrt(float(np.dot(dmu, dmu)) + float(np.dot(dsd, dsd)))
            d[i, j] = d[j, i] = total
    return sites, d


def mixing_weights(distances: np.ndarray, lam: float) -> np.ndarray:
    """Weights of the other sites in one row: (1 - lam) wt_j / sum_k wt_k with wt_j = 1 / d_j.

    Zero distances take all of 1 - lam, split equally (docs/algorithms.md 11.1 DECISION: the limit of the
    reference code's 1e14 for 1/0).
    """
    distances = np.asarray(distances, dtype=np.float64)
    zero = distances == 0.0
    if zero.any():
        share = zero / zero.sum()
    else:
        inverse = 1.0 / distances
        share = inverse / inverse.sum()
    return np.asarray((1.0 - lam) * share, dtype=np.float64)


def similarity_from_distances(d: np.ndarray, lam: float) -> np.ndarray:
    """W with W_ii = lam and the rest of row i from `mixing_weights`; a lone site gets W = [[1]]."""
    n = d.shape[0]
    if n == 1:
        return np.ones((1, 1))
    w = np.zeros((n, n))
    for i in range(n):
        others = [j for j in range(n) if j != i]
        w[i, others] = mixing_weights(d[i, others], lam)
        w[i, i] = lam
    return w


def similarity_matrix(stats: Mapping[str, LayerStats], lam: float) -> np.ndarray:
    """AdaFed's W from per-site, per-layer (mean, var) statistics; rows and columns in sorted site order.

    Args:
        stats: site id -> layer name -> (per-channel mean, per-channel population variance).
        lam: the self weight lambda.

    Returns:
        W (rows sum to 1); W[i, j] is how much site j's upload counts in site i's model.
    """
    return similarity_from_distances(distance_matrix(stats)[1], lam)


class AdaFed(ServerRule):
    """AdaFed (Chen et al., AAAI 2022), server: psi_i^{t+1} = sum_j W_ij psi_j^{t*} for every participant i.

    BN layers stay local; W is fixed once from feature statistics (`set_statistics`). Under partial
    participation (docs/algorithms.md 11.2 DECISION) row i is renormalised over the participants:
    lam psi_i* + (1 - lam) sum_{j in S_t, j != i} wt_ij psi_j* / sum wt_ij; a lone participant keeps
    its upload. `personal` holds psi_i per participant; `weights` is the uniform mean of the uploads
    (W ignores n_i), used only to start a site that has no personal model yet. A participant
    without statistics gets that mean and is left out of the others' mixes (its distances are unknown).
    """

    name = "adafed"
    summary = "AdaFed: one model per site, mixed by BN feature-statistics similarity (Chen et al. 2022)"
    Params = AdaFedParams
    needs_only_sums = False
    sums_note = (
        "each site's model is mixed by the similarity of its own feature statistics with every other site's: "
        "the PS needs per-site statistics and per-site models"
    )
    params: AdaFedParams
    statistics: ClassVar[FeatureStatistics] = FeatureStatistics.BN_INPUTS  # where W comes from (11.3)

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self.sites: list[str] = []
        self.distances: np.ndarray | None = None

    def keeps_local(self, spec: TensorSpec) -> bool:
        return keeps_norm_local(spec, self.params.norm_types)

    def warmup_rounds(self) -> int:
        """Rounds run as FedBN before AdaFed aggregation starts (0: none)."""
        return 0

    def needs_statistics(self, round_no: int) -> bool:
        """Whether statistics must be collected (`set_statistics`) before aggregating round `round_no`."""
        return self.distances is None and round_no > self.warmup_rounds()

    def round_requirements(self, round_no: int) -> RoundRequirements:
        """The sites send their statistics once, with the update of the last warm-up round (round 1 without
        a warm-up), so W is fixed before the first AdaFed aggregation."""
        if round_no == max(1, self.warmup_rounds()):
            return RoundRequirements(feature_stats=self.statistics)
        return NO_REQUIREMENTS

    def observe_round(self, round_no: int, feature_stats: Mapping[str, LayerStats]) -> None:
        """W is fixed once, from the first statistics that arrive; later ones change nothing."""
        del round_no
        if self.distances is None and feature_stats:
            self.set_statistics(feature_stats)

    def set_statistics(self, stats: Mapping[str, LayerStats]) -> None:
        """Fix W from each site's per-layer (mean, var); docs/algorithms.md 11.1 (sites sorted by id)."""
        self.sites, self.distances = distance_matrix(stats)

    @property
    def similarity(self) -> np.ndarray | None:
        """W (sorted site order), or None before `set_statistics`."""
        return None if self.distances is None else similarity_from_distances(self.distances, self.params.lam)

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        if not inp.updates:
            return AggregateResult(weights=copy_weights(inp.current))
        if inp.round_no <= self.warmup_rounds():
            return AggregateResult(weights=self.average(inp, sample_weights(inp.updates)))  # FedBN phase
        g = self.groups(inp)
        names = g.train + g.floatbuf + g.intbuf
        mean = self.average(inp, uniform_weights(len(inp.updates)))
        index = {site: k for k, site in enumerate(self.sites)}
        personal: dict[str, Weights] = {}
        for u in inp.updates:
            if u.site_id not in index or self.distances is None:
                personal[u.site_id] = {name: mean[name].copy() for name in names}
                continue
            personal[u.site_id] = combine(inp.updates, self._row(u.site_id, inp, index), names, inp.current)
        return AggregateResult(weights=mean, personal=personal)

    def _row(self, site: str, inp: RoundInput, index: Mapping[str, int]) -> list[float]:
        """Coefficients of site's mix over `inp.updates` (in their order, so sums keep site-id order)."""
        assert self.distances is not None
        others = [u.site_id for u in inp.updates if u.site_id != site and u.site_id in index]
        if not others:
            return [1.0 if u.site_id == site else 0.0 for u in inp.updates]
        dist = self.distances[index[site], [index[o] for o in others]]
        coef = dict(zip(others, mixing_weights(dist, self.params.lam), strict=True))
        return [
            self.params.lam if u.site_id == site else float(coef.get(u.site_id, 0.0)) for u in inp.updates
        ]

    def state_dict(self) -> dict[str, Any]:
        if self.distances is None:
            return {}
        return {"sites": list(self.sites), "distances": self.distances.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sites = [str(s) for s in state.get("sites", [])]
        self.distances = None if "distances" not in state else np.array(state["distances"], dtype=np.float64)


class DAdaFed(AdaFed):
    """d-AdaFed: AdaFed's server rule; statistics of the final layer's input only (one layer, L = 1)."""

    name = "d-adafed"
    summary = "d-AdaFed: AdaFed with statistics of the penultimate features only (no BN needed)"
    statistics = FeatureStatistics.PENULTIMATE


class FAdaFed(AdaFed):
    """f-AdaFed: FedBN for `warmup_rounds` rounds, then AdaFed with W from the BN running statistics.

    The warm-up is FedBN's p_i-weighted mean over AdaFed's shared tensors (BN local), so the set of
    tensors that travel stays the same for the whole run.
    """

    name = "f-adafed"
    summary = "f-AdaFed: FedBN warm-up, then AdaFed with W from BN running statistics (no pretrained model)"
    Params = FAdaFedParams
    params: FAdaFedParams
    statistics = FeatureStatistics.BN_RUNNING

    def warmup_rounds(self) -> int:
        if self.params.warmup_rounds is not None:
            return self.params.warmup_rounds
        return self.params.total_rounds // 2


def _std(var: np.ndarray) -> np.ndarray:
    # population variances are >= 0; clip rounding noise so sqrt stays real
    return np.sqrt(np.maximum(np.asarray(var, dtype=np.float64), 0.0))


ABOUT = StrategyDoc(
    section="11",
    title="AdaFed, d-AdaFed, f-AdaFed",
    names=("adafed", "d-adafed", "f-adafed"),
    summary=(
        "Personalised models mixed by similarity: every site gets its own model. BatchNorm layers stay on "
        "the site; every other tensor of site i's model is a mix of all uploads, weighted by row i of a "
        "similarity matrix W. W is fixed once, from feature statistics the sites compute (11.1), and favours "
        "sites whose data look alike. The variants differ only in where the statistics come from (11.3)."
    ),
    server="""
psi_i^{t+1} = sum_j W_ij * psi_j^{t*}         for every participant i (psi = non-BN tensors)
W_ii = lambda;   W_ij = (1 - lambda) * (1/d_ij) / sum_{k != i} (1/d_ik)      (11.1)
partial participation: row i renormalised over this round's participants (11.2)
the shared model sent to newcomers = uniform mean of the uploads; BN layers never leave the sites
""",
    client="""
load psi_i (its personal non-BN tensors) and its own BN layers; train E epochs on the plain loss;
upload the non-BN tensors; keep the BN layers (affine parameters and buffers) on disk
""",
    state=(
        "Server: the site list and the distance matrix d (W follows from d and lambda). Sites: their BN "
        "layers; their personal tensors arrive with each task."
    ),
    papers=("Chen, Lu, Wang, Qin, Qin: Federated learning with adaptive batchnorm for "
            "personalized healthcare, AAAI 2022; journal version (FedAP): Lu, Wang, Chen, Qin, Xu, "
            "Dimitriadis, Qin: Personalized federated learning with adaptive batchnorm for healthcare, IEEE "
            "Transactions on Big Data (arXiv 2112.00734); the authors' code (microsoft/PersonalizedFL, "
            "`fedap`).",),
    differences=(
        "Population variance (divide by the count) for the statistics; the authors' code merges per-batch "
        "unbiased variances. The difference is negligible for realistic counts.",
        "Zero distances (identical statistics) share 1 - lambda equally and the other sites get 0: the limit "
        "of the authors' code, which substitutes 1e14 for 1/0.",
        "Partial participation (the paper assumes every site every round): row i is renormalised over the "
        "participants; a lone participant keeps its own upload; stale models of absent sites are never used.",
        "lambda = 0.5 by default (paper); the authors' run script uses 0.3 for MedMNIST.",
        "The pretrained model must come from outside the federation (a public checkpoint, the PS's "
        "`pretrained`); a simulation may pretrain on a stratified share of each site's training rows "
        "(`pretrain_fraction`), as the paper does with a share of the data.",
    ),
    subsections=(
        Subsection("11.1", "Setup: statistics and the similarity matrix", """
Once, with its update of round 1 (the task asks for it), every site passes its training samples through the
pretrained model in evaluation mode (no parameter or running-statistic changes) and, for every BatchNorm
layer l, computes the
per-channel mean mu_i^l and population variance r_i^l of the tensor entering the layer, over all samples and
all non-channel positions (N, H, W for images; N, L for sequences; N for tables). It sends them with n_i.
The server then fixes, for every pair of sites (sorted by id):

    d_ij = sum_l sqrt( ||mu_i^l - mu_j^l||^2 + ||sqrt(r_i^l) - sqrt(r_j^l)||^2 )

which is, per layer, the 2-Wasserstein distance between diagonal Gaussians, summed over layers (not
squared). Row i of W: W_ii = lambda and W_ij = (1 - lambda) * (1/d_ij) / sum_{k != i} (1/d_ik). Rows sum to 1;
W is not symmetric in general. Decision: when some d_ij = 0, those sites share 1 - lambda equally and the
others get 0. The distances are checkpointed and never recomputed; a site that joins later, without
statistics, gets the uniform mean and stays out of the other sites' mixes.
"""),
        Subsection("11.2", "Training rounds and partial participation", """
Each task carries the site's personalised non-BN tensors psi_i (round 1: the common initial model, so every
site starts identical; the pretrained model is used for the statistics only). The site trains with its own
BN layers and uploads its non-BN tensors. Local: the normalization layers of `norm_types` (default
BatchNorm only; the paper's choice), affine parameters and buffers. Shared: everything else, including
buffers of other layers. Evaluation always uses each site's own composed model on its own data.

Decision for partial participation: for a participant i,

    psi_i^{t+1} = lambda * psi_i^{t*} + (1 - lambda) * sum_{j in S_t, j != i} (1/d_ij) psi_j^{t*} / D_i
    D_i         = sum_{j in S_t, j != i} (1/d_ij)

a lone participant keeps its upload, and models of absent sites are not used. W ignores n_i by design.
"""),
        Subsection("11.3", "Variants", """
- `adafed`: statistics of the inputs of every BatchNorm layer, with the pretrained model.
- `d-adafed`: statistics of one tensor only, the input of the final layer (the penultimate features, one
  value per feature), so L = 1; works with models without BatchNorm (BatchNorm layers, if any, still stay
  local).
- `f-adafed`: no pretrained model. The first `warmup_rounds` rounds run FedBN over AdaFed's shared tensors
  (p_i-weighted mean, BN local); at the end of the warm-up the sites send the running mean and variance of
  their own BN layers, which replace mu and r in 11.1; AdaFed aggregation follows. Decision: `warmup_rounds`
  defaults to floor(`total_rounds` / 2), half of the run, as in the paper's comparison.
"""),
        Subsection("11.4", "Settings", """
lambda = 0.5 (paper). The authors' code trains with SGD at learning rate 0.01, one local epoch, batch 32,
cross-entropy; the paper reports that about 20 rounds suffice. The pretrained model in the paper is trained
on a random 20 % of the pooled data (the code: a class-stratified 30 %, 150 epochs); in a hospital network
it has to come from outside the federation.
"""),
        Subsection("11.5", "Pitfalls", """
- Statistics must be computed in evaluation mode: training mode would use batch statistics and overwrite the
  pretrained model's buffers.
- Layers with many channels or large activations dominate d_ij.
- Feature statistics say something about a site's data: they leave the site once.
- W is fixed: a new site needs its statistics and a recomputation.
- With many small sites the estimate of W degrades (the paper's observation).
- f-AdaFed needs BatchNorm layers; d-AdaFed does not.
"""),
        Subsection("11.6", "Worked example", """
Three sites, two BN layers (2 channels, then 1), lambda = 0.5. Layer-1 means [0, 0], [1, 0], [0, 0] and
variances [1, 1], [1, 1], [4, 1]; layer-2 means [0], [3], [0] and variances [1], [1], [1]. Then
d_12 = 1 + 3 = 4, d_13 = 1 + 0 = 1, d_23 = sqrt(2) + 3 = 4.4142135624 and

    W = [[0.5,          0.1,          0.4         ],
         [0.2623069601, 0.5,          0.2376930399],
         [0.4076504844, 0.0923495156, 0.5         ]]

Scalar uploads psi* = (1, 2, 3) give personal values (1.9, 1.9753860798, 2.0923495156) and a shared mean
of 2. With only sites 1 and 2 taking part, both get 0.5 * own + 0.5 * other = 1.5. Statistics check: one
channel holding 1, 2, 3, 6 has mean 3 and population variance 3.5.
"""),
    ),
)
