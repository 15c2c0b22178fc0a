"""AdaFed, d-AdaFed, f-AdaFed (Chen et al. 2022; docs/algorithms.md 11): per-site mixes by feature similarity."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
from pydantic import AliasChoices, Field, field_validator

from fedmqtt.strategies.aggregate import combine, copy_weights, sample_weights, uniform_weights
from fedmqtt.strategies.base import AggregateResult, RoundInput, TensorSpec, Weights
from fedmqtt.strategies.params import NormFamily, StrategyParams, expand_norm_types
from fedmqtt.strategies.rule import ServerRule, keeps_norm_local

LayerStats = Mapping[str, tuple[np.ndarray, np.ndarray]]  # layer -> (per-channel mean, population variance)


class AdaFedParams(StrategyParams):
    lam: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        validation_alias=AliasChoices("lam", "lambda"),
        description="self weight lambda = W_ii, in (0, 1] (paper: 0.5)",
    )
    norm_types: tuple[NormFamily, ...] = Field(
        default=("batchnorm",), description="normalization layers kept local (docs/algorithms.md 11.2: BatchNorm)"
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
    params: AdaFedParams

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
        coef = dict(zip(others, mixing_weights(dist, self.params.lam)))
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


class FAdaFed(AdaFed):
    """f-AdaFed: FedBN for `warmup_rounds` rounds, then AdaFed with W from the BN running statistics.

    The warm-up is FedBN's p_i-weighted mean over AdaFed's shared tensors (BN local), so the set of
    tensors that travel stays the same for the whole run.
    """

    name = "f-adafed"
    summary = "f-AdaFed: FedBN warm-up, then AdaFed with W from BN running statistics (no pretrained model)"
    Params = FAdaFedParams
    params: FAdaFedParams

    def warmup_rounds(self) -> int:
        if self.params.warmup_rounds is not None:
            return self.params.warmup_rounds
        return self.params.total_rounds // 2


def _std(var: np.ndarray) -> np.ndarray:
    # population variances are >= 0; clip rounding noise so sqrt stays real
    return np.sqrt(np.maximum(np.asarray(var, dtype=np.float64), 0.0))
