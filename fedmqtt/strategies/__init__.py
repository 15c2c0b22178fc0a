"""Server strategies by name. Each is pure numpy (never torch) so the PS stays torch-free."""

from __future__ import annotations

from fedmqtt.errors import ConfigError
from fedmqtt.strategies.base import SiteUpdate, Strategy, Weights
from fedmqtt.strategies.fedavg import FedAvg

STRATEGIES: dict[str, type] = {"fedavg": FedAvg}


def build_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ConfigError(f"unknown algorithm {name!r}; available: {', '.join(sorted(STRATEGIES))}") from None


__all__ = ["STRATEGIES", "SiteUpdate", "Strategy", "Weights", "build_strategy"]
