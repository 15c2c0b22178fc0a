"""Common plumbing of the server rules: params, the shared/local split by tags, local pass-through."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from fedmqtt.strategies.aggregate import Coefficients, TensorGroups, combine, copy_weights, split_groups
from fedmqtt.strategies.base import (
    NO_REQUIREMENTS,
    AggregateResult,
    LayerStats,
    Manifest,
    RoundInput,
    RoundRequirements,
    SiteUpdate,
    TensorSpec,
    Weights,
)
from fedmqtt.strategies.params import NoParams, StrategyParams, parse_params

NORM_FAMILIES = ("batchnorm", "instancenorm", "groupnorm", "layernorm")


def norm_family(spec: TensorSpec) -> str | None:
    """`batchnorm` (BatchNorm1d/2d/3d, SyncBatchNorm, lazy ones), `instancenorm`, `groupnorm`, `layernorm`,
    another lowered module type name for an unknown normalization layer, or None for a non-NORM tensor.
    """
    for tag in spec.tags:
        if tag.startswith("NORM:"):
            kind = tag[len("NORM:") :].lower()
            return next((family for family in NORM_FAMILIES if family in kind), kind)
    return None


def keeps_norm_local(spec: TensorSpec, norm_types: Sequence[str]) -> bool:
    """Whether `spec` belongs to a normalization layer of one of `norm_types` (families, see `norm_family`).

    A normalization type outside the known families is local only when every family is (Hwang et al.'s intent).
    """
    family = norm_family(spec)
    if family is None:
        return False
    return family in norm_types or set(norm_types) >= set(NORM_FAMILIES)


class ServerRule:
    """Base class of every strategy: validated `Params`, everything shared unless `keeps_local` says not."""

    name: str = ""  # registry name (a plain attribute, as the Strategy protocol declares it)
    summary: str = ""  # one line for `fedmqtt algorithms`
    Params: ClassVar[type[StrategyParams]] = NoParams
    # Keys of SiteUpdate.extras the rule reads (docs/algorithms.md 18.2), so callers can check uplinks first.
    uplink_extras: ClassVar[tuple[str, ...]] = ()
    # Whether the server needs only (weighted) sums of what the sites send, so that the rule can run under secure
    # aggregation (docs/secure-aggregation.md), where the PS sees nothing but the sum; `sums_note` says how, or why
    # not. A rule that does not declare it is not run under secure aggregation.
    needs_only_sums: ClassVar[bool] = False
    sums_note: ClassVar[str] = "not declared: the rule has not been checked for secure aggregation"
    # Whether the server step depends on the updates only through their sample-weighted mean (FedAvg, FedProx,
    # FedPer, FedBN, the FedOpt family): then the securely summed mean stands in for the updates
    # (fedmqtt/strategies/sums.py). Rules that need only sums but other sums (SCAFFOLD's variates, FedNova's
    # scalars) need their own path, not wired yet.
    from_weighted_mean: ClassVar[bool] = False
    # Whether, under secure aggregation, the sites also mask p_i times their control-variate deltas into the same
    # vector (SCAFFOLD): the PS then hands the rule their sum next to the mean (fedmqtt/secagg/weighted.py).
    sums_variates: ClassVar[bool] = False
    # Whether the server step needs, instead of the mean, the sites' updates over their local work and its sums
    # (FedNova): the PS then hands the rule those sums (`aggregate_from_sums`, fedmqtt/strategies/sums.py).
    sums_normalised: ClassVar[bool] = False
    # Whether the server step depends on the updates only through their plain (unweighted) mean, and perhaps how
    # many sites it holds (FedFBN, FedDyn): under secure aggregation each site then weighs its masked vector by 1
    # (`SecAggTerms.uniform`) and the PS hands the rule that mean (`aggregate_from_uniform_mean`,
    # fedmqtt/strategies/sums.py).
    sums_uniform: ClassVar[bool] = False

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self.params = parse_params(self.name, self.Params, params)

    def weighted_mean_refusal(self) -> str | None:
        """Why this rule, with its parameters, cannot aggregate from the sample-weighted mean alone (None: it can).
        Each site weighs its masked vector by its own sample count, so a rule set to `weighting = "uniform"` would
        need another sum (a count of 1 per site) that is not wired."""
        if not self.from_weighted_mean:
            return f"{self.name} does not aggregate from the weighted mean of the updates alone"
        if getattr(self.params, "weighting", "samples") != "samples":
            return (f"{self.name} with weighting = \"uniform\" needs the plain mean of the updates; under secure "
                    "aggregation the PS unmasks only the sample-weighted mean (weighting = \"samples\")")
        return None

    def keeps_local(self, spec: TensorSpec) -> bool:
        """Whether the tensor stays on the site (never sent, never aggregated)."""
        del spec
        return False

    def shared_names(self, manifest: Manifest) -> list[str]:
        """Tensors that travel between sites and server (sorted). The rest stays on the sites."""
        return sorted(name for name, spec in manifest.items() if not self.keeps_local(spec))

    def site_hyper(self, site_id: str, enrolled: Mapping[str, int]) -> dict[str, float]:
        """Per-site hyper-parameters for the downlink; none by default."""
        del site_id, enrolled
        return {}

    def round_requirements(self, round_no: int) -> RoundRequirements:
        """What the sites send besides their tensors in round `round_no`: nothing extra by default."""
        del round_no
        return NO_REQUIREMENTS

    def observe_round(self, round_no: int, feature_stats: Mapping[str, LayerStats]) -> None:
        """What came with round `round_no`'s updates besides the tensors; ignored by default."""
        del round_no, feature_stats

    def state_dict(self) -> dict[str, Any]:
        """Server state to checkpoint; stateless rules have none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output; stateless rules accept only an empty state."""
        if state:
            raise ValueError(f"{self.name}: keeps no server state, got keys {sorted(state)}")

    def aggregate_train(self, inp: RoundInput) -> AggregateResult:
        raise NotImplementedError

    # -- helpers for subclasses ---------------------------------------------------------------------
    def groups(self, inp: RoundInput) -> TensorGroups:
        """The shared names in `inp.current` by treatment; names missing from the manifest count as shared."""
        names = [n for n in inp.current if n not in inp.manifest or not self.keeps_local(inp.manifest[n])]
        return split_groups(names, inp.manifest, inp.current)

    def complete(self, inp: RoundInput, aggregated: Weights) -> Weights:
        """`aggregated` plus copies of the local tensors `current` happened to carry, in `current`'s order.

        Keeping the local tensors (e.g. FedBN's round-1 NORM values) makes the result a drop-in
        replacement for `current`; they are never changed by the server.
        """
        # Copies of the kept tensors only: copying all of `current` first cost the PS a whole model per round
        return {name: aggregated[name] if name in aggregated else np.array(inp.current[name], copy=True)
                for name in inp.current}

    def average(
        self, inp: RoundInput, weights: Coefficients, updates: Sequence[SiteUpdate] | None = None
    ) -> Weights:
        """Convex combination of every shared tensor (integer buffers: max), local tensors unchanged."""
        updates = inp.updates if updates is None else updates
        if not updates:
            return copy_weights(inp.current)
        g = self.groups(inp)
        return self.complete(inp, combine(updates, weights, g.train + g.floatbuf + g.intbuf, inp.current))


def float_state(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Copies of float64 server-state arrays (moments, variates) for `state_dict`."""
    return {name: np.array(value, dtype=np.float64, copy=True) for name, value in arrays.items()}
