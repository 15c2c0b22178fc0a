"""The runner's metrics hooks: the Prometheus endpoint when the config asks for one (`[metrics] port`), else hooks
that do nothing, so a PS without an endpoint never imports prometheus-client."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ps_daemon.config import DaemonConfig
from ps_daemon.monitoring import MonitoredPs


class MetricsHook(Protocol):
    """What the runner calls: `start` first, `sample` (with itself) once its channel exists and then every turn of
    its loop, `close` last (`finished`: the run is done; `interrupted`: whether a stop was asked for, checked
    while lingering)."""

    def start(self) -> None: ...

    def sample(self, ps: MonitoredPs) -> None: ...

    def close(self, ps: MonitoredPs, *, finished: bool, interrupted: Callable[[], bool]) -> None: ...


class NoMetrics:
    """No endpoint configured: every hook does nothing (and prometheus-client is never imported)."""

    def start(self) -> None:
        pass

    def sample(self, ps: MonitoredPs) -> None:
        pass

    def close(self, ps: MonitoredPs, *, finished: bool, interrupted: Callable[[], bool]) -> None:
        pass


def metrics_for(config: DaemonConfig) -> MetricsHook:
    """The endpoint the config asks for (`[metrics] port`), or hooks that do nothing."""
    if config.metrics.port is None:
        return NoMetrics()
    from ps_daemon.metrics_endpoint import MetricsEndpoint

    return MetricsEndpoint(config)
