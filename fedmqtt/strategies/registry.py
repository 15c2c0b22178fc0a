"""The registry: every server strategy by its name, in the order of docs/algorithms.md.

A module of its own so that nothing a strategy module imports leads back here (no import loop).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedmqtt.errors import ConfigError
from fedmqtt.strategies.adafed import AdaFed, DAdaFed, FAdaFed
from fedmqtt.strategies.base_local import Base
from fedmqtt.strategies.dp_fedavg import DPFedAvg
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
from fedmqtt.strategies.rule import ServerRule
from fedmqtt.strategies.scaffold import Scaffold

# In the order of docs/algorithms.md, so `fedmqtt algorithms` lists them as the spec does.
_CLASSES: tuple[type[ServerRule], ...] = (
    FedAvg,
    FedProx,
    FedBN,
    FedPxN,
    FedAdam,
    FedAdagrad,
    FedYogi,
    FedDyn,
    Scaffold,
    FedNova,
    FedAdp,
    FedDkw,
    AdaFed,
    DAdaFed,
    FAdaFed,
    FedPer,
    Base,
    FedFBN,
    DPFedAvg,
)
STRATEGIES: dict[str, type[ServerRule]] = {cls.name: cls for cls in _CLASSES}


def build_strategy(name: str, params: Mapping[str, Any] | None = None) -> ServerRule:
    """The strategy registered as `name`, with validated hyper-parameters.

    Args:
        name: registry name, e.g. "fedavg", "fedadam", "d-adafed".
        params: hyper-parameters of that rule (None: all defaults).

    Raises:
        ConfigError: unknown name (the message lists the known ones) or a bad parameter.
    """
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm {name!r}; available: {', '.join(STRATEGIES)}") from None
    return cls(params)


def describe_strategies() -> list[tuple[str, str, list[tuple[str, Any, str]]]]:
    """(name, summary, [(param, default, description)]) for every registered rule, for a CLI listing."""
    rows = []
    for name, cls in STRATEGIES.items():
        fields = [
            (field, info.default, info.description or "") for field, info in cls.Params.model_fields.items()
        ]
        rows.append((name, cls.summary, fields))
    return rows
