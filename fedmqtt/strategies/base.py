"""The Strategy protocol: pure numpy server rules, no I/O, no clock, no global random.

A strategy sees numpy tensors keyed by state-dict name plus a tensor manifest (docs/algorithms.md 0.2)
that tags every name (TRAIN, NORM:<type>, FLOATBUF, INTBUF, HEAD); it selects tensors by tags,
never by name. It returns the next shared model, optional per-site tensors (personalised
delivery on `ps/task/<site>`), optional server extras every site needs (SCAFFOLD `c`, sent on
`ps/model`) and, where the evaluated model differs from the one sent (FedDyn), that model.

Two hooks frame each round, in the spirit of Flower's configure/aggregate pair: `round_requirements` says
what the sites must send besides their tensors before the round starts, and `observe_round` hands the rule
what came back with the updates before they are aggregated. The PS calls both for every rule and never asks
which rule it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

import numpy as np

Weights = dict[str, np.ndarray]
LayerStats = Mapping[str, tuple[np.ndarray, np.ndarray]]  # layer -> (per-channel mean, population variance)


@dataclass(frozen=True)
class TensorSpec:
    """One state-dict entry as the site's model registry describes it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    tags: frozenset[str]

    @property
    def is_train(self) -> bool:
        return "TRAIN" in self.tags

    @property
    def is_norm(self) -> bool:
        return any(t.startswith("NORM:") for t in self.tags)

    @property
    def is_floatbuf(self) -> bool:
        return "FLOATBUF" in self.tags

    @property
    def is_intbuf(self) -> bool:
        return "INTBUF" in self.tags

    @property
    def is_head(self) -> bool:
        return "HEAD" in self.tags


Manifest = Mapping[str, TensorSpec]


def manifest_from_dict(raw: Mapping[str, Mapping[str, Any]]) -> dict[str, TensorSpec]:
    """Build a Manifest from `fedmqtt.training.models.tensor_manifest` output (or its wire form)."""
    return {
        name: TensorSpec(
            name, tuple(int(d) for d in spec["shape"]), str(spec["dtype"]), frozenset(spec["tags"])
        )
        for name, spec in raw.items()
    }


@dataclass(frozen=True)
class SiteUpdate:
    """One site's contribution to a round, as the strategy sees it (numpy only).

    `tensors` holds the site's full post-training values of the tensors it shares (docs/algorithms.md
    0.3 DECISION: the server forms deltas itself). `extras` holds algorithm-specific uplink fields
    (docs/algorithms.md 18.2), e.g. {"delta_c": Weights} for SCAFFOLD, {"a_norm": float} for FedNova,
    {"label_histogram": {"0": 12, "1": 30}} for FedDkw.
    """

    site_id: str
    tensors: Mapping[str, np.ndarray]
    n_samples: int
    local_steps: int
    extras: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundInput:
    """Everything a server rule may use for one round.

    `current` are the shared tensors the server sent this round (w_t); `updates` are sorted by site
    id (sums run in that order); `enrolled` maps every enrolled site (participating or not) to its
    n_i, so rules that need N or pi_i = n_i / n (FedDyn, SCAFFOLD) have them.
    """

    round_no: int
    current: Weights
    updates: list[SiteUpdate]
    enrolled: Mapping[str, int]
    manifest: Manifest


@dataclass(frozen=True)
class AggregateResult:
    """What the server publishes next: the shared model, per-site tensors, extras for every site."""

    weights: Weights
    personal: Mapping[str, Weights] = field(default_factory=dict)
    extras: Mapping[str, Weights] = field(default_factory=dict)
    eval_weights: Weights | None = None  # FedDyn: evaluate theta_avg, not theta_send
    # Numbers about the round the rule wants in the round's record (DP-FedAvg: clip norm, epsilon, delta).
    diagnostics: Mapping[str, float] = field(default_factory=dict)


class FeatureStatistics(IntEnum):
    """Which feature statistics a site computes for the server (docs/algorithms.md 11.1, 11.3).

    The value is the `feature_stats` code a train task carries; the site's trainer (fedmqtt.training.statistics)
    knows the same codes.
    """

    BN_INPUTS = 1  # the input of every BatchNorm layer, through the pretrained model
    PENULTIMATE = 2  # the input of the final layer, through the pretrained model
    BN_RUNNING = 3  # the running mean and variance of the site's own BatchNorm layers


@dataclass(frozen=True)
class RoundRequirements:
    """What the sites must send with a round's update besides their tensors (nothing, by default)."""

    feature_stats: FeatureStatistics | None = None


NO_REQUIREMENTS = RoundRequirements()


class Strategy(Protocol):
    """A server rule; build one with `strategy_class(params: dict[str, float])`."""

    name: str

    def shared_names(self, manifest: Manifest) -> list[str]:
        """Tensors that travel between sites and server (sorted). The rest stays on the sites."""
        ...

    def site_hyper(self, site_id: str, enrolled: Mapping[str, int]) -> dict[str, float]:
        """Per-site hyper-parameters for the downlink (e.g. FedDyn alpha_i, FedProx mu)."""
        ...

    def round_requirements(self, round_no: int) -> RoundRequirements:
        """What every selected site must send with its update of round `round_no` besides the tensors."""
        ...

    def observe_round(self, round_no: int, feature_stats: Mapping[str, LayerStats]) -> None:
        """Before round `round_no` is aggregated: the feature statistics that came with its updates, by site
        (only sites that sent some; empty in most rounds)."""
        ...

    def aggregate_train(self, inp: RoundInput) -> AggregateResult: ...

    def state_dict(self) -> dict[str, Any]:
        """Server state to checkpoint (numpy arrays and plain values only)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
