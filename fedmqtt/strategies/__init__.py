"""Server strategies by name. Each is pure numpy (never torch) so the PS stays torch-free.

The names live in `registry`; this package re-exports them with the protocol types, for callers.
"""

from __future__ import annotations

from fedmqtt.strategies.adafed import AdaFed, DAdaFed, FAdaFed
from fedmqtt.strategies.base import (
    AggregateResult,
    FeatureStatistics,
    LayerStats,
    Manifest,
    RoundInput,
    RoundRequirements,
    SiteUpdate,
    Strategy,
    TensorSpec,
    Weights,
    manifest_from_dict,
)
from fedmqtt.strategies.base_local import Base
from fedmqtt.strategies.fedadp import FedAdp
from fedmqtt.strategies.fedavg import FedAvg
from fedmqtt.strategies.fedbn import FedBN
from fedmqtt.strategies.feddkw import FedDkw
from fedmqtt.strategies.feddyn import FedDyn
from fedmqtt.strategies.fedfbn import FedFBN
from fedmqtt.strategies.fednova import FedNova
from fedmqtt.strategies.fedopt import FedAdagrad, FedAdam, FedYogi
from fedmqtt.strategies.fedper import FedPer
from fedmqtt.strategies.fedprox import FedProx
from fedmqtt.strategies.fedpxn import FedPxN
from fedmqtt.strategies.registry import STRATEGIES, build_strategy, describe_strategies
from fedmqtt.strategies.rule import ServerRule
from fedmqtt.strategies.scaffold import Scaffold

__all__ = [
    "STRATEGIES",
    "AdaFed",
    "AggregateResult",
    "Base",
    "DAdaFed",
    "FAdaFed",
    "FeatureStatistics",
    "FedAdagrad",
    "FedAdam",
    "FedAdp",
    "FedAvg",
    "FedBN",
    "FedDkw",
    "FedDyn",
    "FedFBN",
    "FedNova",
    "FedPer",
    "FedProx",
    "FedPxN",
    "FedYogi",
    "LayerStats",
    "Manifest",
    "RoundInput",
    "RoundRequirements",
    "Scaffold",
    "ServerRule",
    "SiteUpdate",
    "Strategy",
    "TensorSpec",
    "Weights",
    "build_strategy",
    "describe_strategies",
    "manifest_from_dict",
]
