"""The PS's Prometheus endpoint: the newest `PsSnapshot` as metric families, on prometheus_client's own HTTP
server, in a registry of its own (the process's global one would also export whatever a library registers).

Started with the PS once its channel exists, stopped with it; `[metrics] linger_s` keeps a finished run's last
numbers up for one more scrape. docs/monitoring.md lists the metrics and shows how to scrape them.
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.utils import floatToGoString

from fedmqtt.errors import ConfigError
from ps_daemon.config import DaemonConfig, MetricsConfig
from ps_daemon.monitoring import METRICS, OTHER, PHASES, SAMPLE_EVERY_S, MonitoredPs, PsSnapshot, SnapshotBuilder

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger("fedmqtt.ps")
LINGER_POLL_S = 0.2  # how soon a SIGTERM ends the linger


def _gauge(name: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, METRICS[name].help, labels=list(METRICS[name].labels))


def _counter(name: str) -> CounterMetricFamily:
    return CounterMetricFamily(name, METRICS[name].help, labels=list(METRICS[name].labels))


def _scalar(name: str, value: float) -> Metric:
    """A family of one unlabelled sample, of the type METRICS gives it."""
    family = _counter(name) if METRICS[name].kind == "counter" else _gauge(name)
    family.add_metric([], value)
    return family


def _per_site(name: str, counts: Mapping[str, int], sites: tuple[str, ...]) -> Metric:
    """One series per configured site (0 until it counts, so rate() works from the start), plus `other` if any."""
    family = _counter(name)
    for site in (*sites, *([OTHER] if OTHER in counts else [])):
        family.add_metric([site], counts.get(site, 0))
    return family


def families(s: PsSnapshot) -> Iterator[Metric]:
    """Every metric family of one snapshot; an unknown value (no deadline, no best round, no epsilon) is left
    out rather than exported as a made-up number."""
    p = "fedmqtt_ps_"
    run = InfoMetricFamily(p + "run", METRICS[p + "run"].help)  # labels: the value's keys
    run.add_metric([], {"run_id": s.run_id, "algorithm": s.algorithm, "session": s.session})
    yield run
    yield _scalar(p + "round", s.round)
    yield _scalar(p + "rounds_planned", s.rounds_planned)
    yield _scalar(p + "rounds_closed", s.rounds_closed)
    phase = _gauge(p + "phase")
    for name in PHASES:
        phase.add_metric([name], 1.0 if s.phase == name else 0.0)
    yield phase
    yield _scalar(p + "sites_configured", len(s.sites))
    yield _scalar(p + "sites_online", len(s.online))
    online = _gauge(p + "site_online")
    for site in s.sites:
        online.add_metric([site], 1.0 if site in s.online else 0.0)
    yield online
    yield _scalar(p + "sites_selected", s.selected)
    yield _scalar(p + "round_answers", s.round_answers)
    if s.deadline is not None:
        yield _scalar(p + "round_deadline_timestamp_seconds", s.deadline)
    if s.last_progress is not None:
        yield _scalar(p + "last_progress_timestamp_seconds", s.last_progress)
    b = s.round_seconds
    durations = HistogramMetricFamily(p + "round_duration_seconds", METRICS[p + "round_duration_seconds"].help)
    buckets = [(floatToGoString(bound), n) for bound, n in zip(b.bounds, b.cumulative, strict=True)]
    durations.add_metric([], [*buckets, ("+Inf", b.count)], sum_value=b.total)
    yield durations
    if s.last_round_seconds is not None:
        yield _scalar(p + "last_round_duration_seconds", s.last_round_seconds)
    if s.last_round_metric is not None:
        metric = _gauge(p + "last_round_val_metric")
        metric.add_metric([s.selection_metric], s.last_round_metric)
        yield metric
    if s.last_round_train_loss is not None:
        yield _scalar(p + "last_round_train_loss", s.last_round_train_loss)
    if s.best_round is not None:
        yield _scalar(p + "best_round", s.best_round)
    yield _per_site(p + "updates_accepted", s.accepted, s.sites)
    yield _per_site(p + "updates_no_step", s.no_step, s.sites)
    yield _per_site(p + "stragglers", s.stragglers, s.sites)
    refused = _counter(p + "refused")
    for (site, reason), n in sorted(s.refused.items()):
        refused.add_metric([site, reason], n)
    yield refused
    yield _scalar(p + "messages_received", s.messages_received)
    yield _scalar(p + "messages_duplicate", s.duplicates)
    yield _scalar(p + "bytes_sent", s.bytes_sent)
    yield _scalar(p + "bytes_received", s.bytes_received)
    yield _scalar(p + "broker_connected", 1.0 if s.broker_connected else 0.0)
    yield _scalar(p + "broker_connects", s.broker_connects)
    t = s.transfers
    yield _scalar(p + "chunks_received", t.chunks)
    problems = _counter(p + "chunk_problems")
    for problem, n in (("duplicate", t.duplicates), ("stale", t.stale), ("corrupt", t.corrupt)):
        problems.add_metric([problem], n)
    yield problems
    yield _scalar(p + "chunk_refetches", t.refetches)
    transfers = _counter(p + "chunked_transfers")
    transfers.add_metric(["completed"], t.completed)
    transfers.add_metric(["failed"], t.failed)
    yield transfers
    yield _scalar(p + "upload_turns", s.upload_turns)
    saves = SummaryMetricFamily(p + "checkpoint_save_seconds", METRICS[p + "checkpoint_save_seconds"].help)
    saves.add_metric([], count_value=s.checkpoints.count, sum_value=s.checkpoints.total_s)
    yield saves
    if s.checkpoints.last_s is not None:
        yield _scalar(p + "checkpoint_last_save_seconds", s.checkpoints.last_s)
    if s.epsilon is not None:
        yield _scalar(p + "privacy_epsilon", s.epsilon)


class SnapshotCollector:
    """A prometheus_client collector of the newest snapshot (set by the PS's loop, read by scrapes)."""

    def __init__(self) -> None:
        self.latest: PsSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        snapshot = self.latest  # one read: the loop may swap in a newer one meanwhile
        if snapshot is not None:
            yield from families(snapshot)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tls_arguments(settings: MetricsConfig) -> dict[str, Any]:
    """start_http_server's TLS arguments for `[metrics]` (none: plain HTTP). Checked before the server starts: the
    files exist, and the key is private (refused, like the parties' credentials files, when group or others can
    read it). TLS 1.2 at least; with `tls_client_ca`, a client certificate from that CA is required."""
    if settings.tls_cert is None or settings.tls_key is None:
        return {}
    for what, path in (("tls_cert", settings.tls_cert), ("tls_key", settings.tls_key),
                       ("tls_client_ca", settings.tls_client_ca)):
        if path is not None and not path.is_file():
            raise ConfigError(f"metrics: [metrics] {what} {path} is not a file")
    mode = settings.tls_key.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"metrics: [metrics] tls_key {settings.tls_key} is open to other users (mode "
                          f"{stat.S_IMODE(mode):04o}); make it private with: chmod 600 {settings.tls_key}")
    # Loaded once here first: prometheus_client binds the port before it loads them, and leaves the socket
    # open when they fail to load.
    try:
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        probe.load_cert_chain(str(settings.tls_cert), str(settings.tls_key))
        if settings.tls_client_ca is not None:
            probe.load_verify_locations(cafile=str(settings.tls_client_ca))
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"metrics: cannot use [metrics] tls_cert {settings.tls_cert}, tls_key {settings.tls_key}"
                          f" or tls_client_ca {settings.tls_client_ca}: {exc} (a PEM certificate, its own private "
                          "key, a PEM CA certificate)") from None
    args: dict[str, Any] = {"certfile": str(settings.tls_cert), "keyfile": str(settings.tls_key),
                            "tls_min_version": ssl.TLSVersion.TLSv1_2}
    if settings.tls_client_ca is not None:
        args.update(client_cafile=str(settings.tls_client_ca), client_auth_required=True)
    return args


class MetricsEndpoint:
    """The runner's metrics hooks (ps_daemon.monitoring.MetricsHook) with a real endpoint behind them."""

    def __init__(self, config: DaemonConfig) -> None:
        assert config.metrics.port is not None
        self.settings = config.metrics
        self.port: int = config.metrics.port
        self.builder = SnapshotBuilder(config)
        self.collector = SnapshotCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)  # a duck-typed Collector: collect() is all it needs
        self._server: WSGIServer | None = None
        self._sampled_at = -float("inf")

    def start(self) -> None:
        """Listen; until the first `sample` a scrape finds no metrics (the PS is loading its state)."""
        bind, tls = self.settings.bind, tls_arguments(self.settings)
        try:
            self._server, _ = start_http_server(self.port, addr=bind, registry=self.registry, **tls)
        except OSError as exc:
            raise ConfigError(f"metrics: cannot serve on {bind} port {self.port}: {exc.strerror or exc} "
                              "(another process on that port? change [metrics] port or bind)") from None
        host = f"[{bind}]" if ":" in bind else bind
        scheme = "https" if tls else "http"
        log.info("Prometheus metrics on %s://%s:%d/metrics%s", scheme, host, self.port,
                 " (client certificates required)" if self.settings.tls_client_ca else "")
        if not is_loopback(bind) and not tls:
            log.warning("the metrics endpoint listens on %s, beyond this host, without login or TLS: set [metrics] "
                        "tls_cert, tls_key and tls_client_ca, or keep it behind a firewall or a TLS proxy "
                        "(docs/monitoring.md)", bind)
        elif not is_loopback(bind) and self.settings.tls_client_ca is None:
            log.warning("the metrics endpoint listens on %s over TLS without client certificates: anyone who "
                        "reaches it can read it; set [metrics] tls_client_ca to allow only your scrapers", bind)

    def sample(self, ps: MonitoredPs, *, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._sampled_at >= SAMPLE_EVERY_S:
            self._sampled_at = now
            self.collector.latest = self.builder.from_ps(ps)

    def close(self, ps: MonitoredPs, *, finished: bool, interrupted: Callable[[], bool]) -> None:
        if self._server is None:
            return
        self.sample(ps, force=True)
        if finished and self.settings.linger_s > 0:
            log.info("run done: serving its final metrics for %.0f s more ([metrics] linger_s)",
                     self.settings.linger_s)
            end = time.monotonic() + self.settings.linger_s
            while not interrupted() and time.monotonic() < end:
                time.sleep(LINGER_POLL_S)
        server, self._server = self._server, None
        server.shutdown()
        server.server_close()
