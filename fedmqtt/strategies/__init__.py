"""Server strategies by name. Each is pure numpy (never torch) so the PS stays torch-free.

The names live in `registry`; this package re-exports them with the protocol types, for callers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for type checkers; at run time each is imported when first used
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

# Name -> the module that defines it. Loaded on first use (PEP 562), so that importing one module of this package
# (a site's training loop checks its optimiser settings with `params`) does not load every server rule: they cost
# a site process about 45 ms of CPU at start, and a site never aggregates.
_MODULE_OF = {
    "AdaFed": "adafed",
    "DAdaFed": "adafed",
    "FAdaFed": "adafed",
    "AggregateResult": "base",
    "FeatureStatistics": "base",
    "LayerStats": "base",
    "Manifest": "base",
    "RoundInput": "base",
    "RoundRequirements": "base",
    "SiteUpdate": "base",
    "Strategy": "base",
    "TensorSpec": "base",
    "Weights": "base",
    "manifest_from_dict": "base",
    "Base": "base_local",
    "FedAdp": "fedadp",
    "FedAvg": "fedavg",
    "FedBN": "fedbn",
    "FedDkw": "feddkw",
    "FedDyn": "feddyn",
    "FedFBN": "fedfbn",
    "FedNova": "fednova",
    "FedAdagrad": "fedopt",
    "FedAdam": "fedopt",
    "FedYogi": "fedopt",
    "FedPer": "fedper",
    "FedProx": "fedprox",
    "FedPxN": "fedpxn",
    "STRATEGIES": "registry",
    "build_strategy": "registry",
    "describe_strategies": "registry",
    "ServerRule": "rule",
    "Scaffold": "scaffold",
}


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


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
