"""The PS's Prometheus endpoint: snapshots as metric families, served over HTTP by the PS and stopped with it."""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from signed_wire import identity, signed

from broker.config import free_port
from fedmqtt.errors import ConfigError
from fedmqtt.transport import topics
from fedmqtt.transport.bulk import TransferStats
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.memory import MemoryBroker, MemoryTransport
from ps_daemon.config import DaemonConfig
from ps_daemon.metrics_endpoint import MetricsEndpoint, SnapshotCollector
from ps_daemon.monitoring import METRICS, ROUND_SECONDS_BUCKETS, Buckets, DurationTally, PsSnapshot
from ps_daemon.runner import DaemonRunner
from ps_daemon.state import DaemonState
from ps_daemon.status import StatusBoard
from ps_daemon.turns import UploadTurns

SITES = ("site-a", "site-b")
Families = dict[str, Any]


def full_snapshot(**overrides: Any) -> PsSnapshot:
    """A snapshot in which every optional value is known (epsilon included)."""
    values: dict[str, Any] = dict(
        run_id="r1", algorithm="fedavg", session="s1", sites=SITES, rounds_planned=5, selection_metric="auroc",
        phase="training", round=3, online=frozenset({"site-a"}), selected=2, round_answers=1, deadline=2e9,
        last_progress=1.9e9, rounds_closed=2, accepted={"site-a": 2, "site-b": 1, "other": 1}, no_step={},
        stragglers={"site-b": 1},
        round_seconds=Buckets(ROUND_SECONDS_BUCKETS, tuple(1 if b < 10 else 2 for b in ROUND_SECONDS_BUCKETS), 2, 12.0),
        last_round_seconds=9.0, last_round_metric=0.75, last_round_train_loss=0.4, best_round=2,
        refused={("site-a", "malformed"): 3}, messages_received=40, duplicates=1, bytes_sent=1000,
        bytes_received=2000, broker_connected=True, broker_connects=2,
        transfers=TransferStats(chunks=7, completed=1, failed=1, corrupt=1), upload_turns=1,
        checkpoints=DurationTally(count=2, total_s=0.5, last_s=0.2), epsilon=1.5)
    return PsSnapshot(**{**values, **overrides})


def exposition(snapshot: PsSnapshot) -> Families:
    collector = SnapshotCollector()
    collector.latest = snapshot
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return parse(generate_latest(registry).decode())


def parse(text: str) -> Families:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: Families, family: str, sample: str | None = None, **labels: str) -> float:
    found = [s.value for s in fams[family].samples if s.name == (sample or family) and s.labels == labels]
    assert len(found) == 1, (family, labels, fams[family].samples)
    return float(found[0])


def test_every_catalogued_metric_is_exported_with_its_type_and_nothing_else() -> None:
    fams = exposition(full_snapshot())
    expected = {(f"{name}_info" if doc.kind == "info" else name): ("gauge" if doc.kind == "info" else doc.kind)
                for name, doc in METRICS.items()}
    assert {name: f.type for name, f in fams.items()} == expected
    assert all(f.documentation for f in fams.values())


def test_values_and_labels_of_one_snapshot() -> None:
    fams = exposition(full_snapshot())
    p = "fedmqtt_ps_"
    assert value(fams, p + "round") == 3 and value(fams, p + "rounds_closed", p + "rounds_closed_total") == 2
    assert [s.labels["phase"] for s in fams[p + "phase"].samples if s.value == 1] == ["training"]
    assert value(fams, p + "site_online", site="site-a") == 1 and value(fams, p + "site_online", site="site-b") == 0
    accepted = {s.labels["site"]: s.value for s in fams[p + "updates_accepted"].samples}
    assert accepted == {"site-a": 2, "site-b": 1, "other": 1}
    assert {s.labels["site"]: s.value for s in fams[p + "updates_no_step"].samples} == {"site-a": 0, "site-b": 0}
    assert value(fams, p + "refused", p + "refused_total", site="site-a", reason="malformed") == 3
    assert value(fams, p + "round_duration_seconds", p + "round_duration_seconds_bucket", le="5.0") == 1
    assert value(fams, p + "round_duration_seconds", p + "round_duration_seconds_bucket", le="+Inf") == 2
    assert value(fams, p + "round_duration_seconds", p + "round_duration_seconds_sum") == 12.0
    assert value(fams, p + "chunked_transfers", p + "chunked_transfers_total", result="failed") == 1
    assert value(fams, p + "checkpoint_save_seconds", p + "checkpoint_save_seconds_count") == 2
    assert value(fams, p + "last_round_val_metric", metric="auroc") == 0.75
    assert value(fams, p + "run_info", run_id="r1", algorithm="fedavg", session="s1") == 1


def test_unknown_values_are_left_out_never_made_up() -> None:
    fams = exposition(full_snapshot(epsilon=None, deadline=None, best_round=None, last_round_metric=None,
                                    last_round_seconds=None, last_round_train_loss=None,
                                    checkpoints=DurationTally()))
    absent = {"privacy_epsilon", "round_deadline_timestamp_seconds", "best_round", "last_round_val_metric",
              "last_round_duration_seconds", "last_round_train_loss", "checkpoint_last_save_seconds"}
    assert not {f"fedmqtt_ps_{name}" for name in absent} & set(fams)
    assert "fedmqtt_ps_privacy_epsilon" in exposition(full_snapshot(epsilon=0.5))


# -- served over HTTP ------------------------------------------------------------------------------------------
def ps_config(tmp_path: Path, **metrics: Any) -> DaemonConfig:
    return DaemonConfig.model_validate({
        "run_id": "r1", "sites": list(SITES), "rounds": 2, "model": {"name": "mlp", "args": {"in_features": 3}},
        "credentials": str(tmp_path / "unused.toml"), "out_dir": str(tmp_path / "ps"), "metrics": metrics})


@dataclass
class PsParts:
    """What the endpoint reads from a PS, made of the real parts (a full runner also builds the model)."""

    state: DaemonState
    channel: Channel
    status: StatusBoard
    turns: UploadTurns
    outbound: Any


def ps_parts(config: DaemonConfig) -> PsParts:
    channel = Channel(MemoryTransport(MemoryBroker(), client_id="ps"), run_id="r1", identity=identity("r1", "ps"))
    turns = UploadTurns(2)
    return PsParts(DaemonState(phase="waiting_for_sites", round=0, weights={}, model_hash=""), channel,
                   StatusBoard(config, channel, turns), turns, SimpleNamespace(checkpoint_time=DurationTally()))


def scrape(port: int) -> Families:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return parse(answer.read().decode())


def test_the_ps_serves_its_numbers_counts_a_junk_message_and_stops_serving_when_it_stops(tmp_path: Path) -> None:
    # Prepare: a PS runner over the in-process broker, its endpoint on a free loopback port
    port = free_port()
    broker = MemoryBroker()
    ps = DaemonRunner(ps_config(tmp_path, port=port), force=True,
                      transport_factory=lambda **kw: MemoryTransport(broker, **kw), identity=identity("r1", "ps"))
    ps.start()
    try:
        first = scrape(port)
        # Execute: bytes that are no message, on a site's update topic
        update = topics.site_update_topic("r1", "site-a")  # signed by site-a: the signature holds, the body not
        broker.deliver(update, signed("r1", update, b"\xc1 not msgpack"), retain=False)
        end = time.monotonic() + 10
        while not (fams := scrape(port))["fedmqtt_ps_refused"].samples and time.monotonic() < end:
            ps.poll(0.05)
    finally:
        ps.close()
    # Check
    assert value(first, "fedmqtt_ps_phase", phase="waiting_for_sites") == 1
    assert value(first, "fedmqtt_ps_sites_configured") == 2 and value(first, "fedmqtt_ps_round") == 0
    refused = [(s.labels, s.value) for s in fams["fedmqtt_ps_refused"].samples]
    assert refused == [({"site": "site-a", "reason": "malformed"}, 1)]
    assert value(fams, "fedmqtt_ps_messages_received", "fedmqtt_ps_messages_received_total") == 1
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_a_busy_port_stops_the_ps_before_it_touches_the_run(tmp_path: Path) -> None:
    port = free_port()
    ps = DaemonRunner(ps_config(tmp_path, port=port), force=True,
                      transport_factory=lambda **kw: MemoryTransport(MemoryBroker(), **kw),
                      identity=identity("r1", "ps"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(ConfigError, match=f"metrics: cannot serve on 127.0.0.1 port {port}"):
            ps.start()
    assert not hasattr(ps, "state")  # no state loaded or made, no checkpoint removed, no start in the audit log


def test_a_finished_run_lingers_until_its_time_is_up_or_a_stop_is_asked(tmp_path: Path) -> None:
    # Prepare
    port = free_port()
    endpoint = MetricsEndpoint(ps_config(tmp_path, port=port, linger_s=60))
    parts = ps_parts(endpoint.builder.config)
    endpoint.start()
    endpoint.sample(parts)
    stop = threading.Event()
    closing = threading.Thread(target=endpoint.close, args=(parts,),
                               kwargs={"finished": True, "interrupted": stop.is_set})
    # Execute
    closing.start()
    time.sleep(0.3)
    during = scrape(port)
    stop.set()
    closing.join(5)
    # Check: served while lingering, gone soon after the stop
    assert "fedmqtt_ps_round" in during and not closing.is_alive()
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_an_unfinished_run_does_not_linger(tmp_path: Path) -> None:
    port = free_port()
    endpoint = MetricsEndpoint(ps_config(tmp_path, port=port, linger_s=60))
    parts = ps_parts(endpoint.builder.config)
    endpoint.start()
    endpoint.sample(parts)
    started = time.monotonic()
    endpoint.close(parts, finished=False, interrupted=lambda: False)
    assert time.monotonic() - started < 5


def test_a_ps_without_an_endpoint_never_imports_prometheus_client() -> None:
    code = ("import sys; from ps_daemon.runner import DaemonRunner; "
            "assert 'prometheus_client' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- over TLS --------------------------------------------------------------------------------------------------
def _tls_files(tmp_path: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a scraper's client certificate, as PEM files."""
    from broker import certs

    ca = certs.create_ca("metrics test CA")
    server = certs.issue_server_cert(ca, ["127.0.0.1", "localhost"])
    client = certs.issue_client_cert(ca, "prometheus")
    files = {"ca": tmp_path / "ca.crt", "cert": tmp_path / "ps.crt", "key": tmp_path / "ps.key",
             "client_cert": tmp_path / "prom.crt", "client_key": tmp_path / "prom.key"}
    files["ca"].write_bytes(ca.cert_pem)
    files["cert"].write_bytes(server.cert_pem)
    certs.write_private(files["key"], server.key_pem)
    files["client_cert"].write_bytes(client.cert_pem)
    certs.write_private(files["client_key"], client.key_pem)
    return files


def scrape_tls(port: int, files: dict[str, Path], *, client: bool) -> Families:
    import ssl

    context = ssl.create_default_context(cafile=str(files["ca"]))
    if client:
        context.load_cert_chain(str(files["client_cert"]), str(files["client_key"]))
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=5, context=context) as answer:
        return parse(answer.read().decode())


def test_over_tls_with_client_certificates_only_a_scraper_with_one_is_served(tmp_path: Path) -> None:
    # Prepare: the endpoint with a server certificate and a client CA
    files = _tls_files(tmp_path)
    port = free_port()
    endpoint = MetricsEndpoint(ps_config(tmp_path, port=port, tls_cert=str(files["cert"]),
                                         tls_key=str(files["key"]), tls_client_ca=str(files["ca"])))
    parts = ps_parts(endpoint.builder.config)
    endpoint.start()
    try:
        endpoint.sample(parts, force=True)
        # Execute and check: served over TLS to a scraper with a certificate; refused without one; no plain HTTP
        assert value(scrape_tls(port, files, client=True), "fedmqtt_ps_sites_configured") == 2
        with pytest.raises(OSError):  # the handshake fails (URLError, SSLError and resets are OSErrors)
            scrape_tls(port, files, client=False)
        with pytest.raises((OSError, http.client.HTTPException)):
            scrape(port)
    finally:
        endpoint.close(parts, finished=False, interrupted=lambda: False)


def test_over_tls_without_a_client_ca_any_scraper_trusting_the_server_is_served(tmp_path: Path) -> None:
    files = _tls_files(tmp_path)
    port = free_port()
    endpoint = MetricsEndpoint(ps_config(tmp_path, port=port, tls_cert=str(files["cert"]), tls_key=str(files["key"])))
    parts = ps_parts(endpoint.builder.config)
    endpoint.start()
    try:
        endpoint.sample(parts, force=True)
        assert value(scrape_tls(port, files, client=False), "fedmqtt_ps_round") == 0
    finally:
        endpoint.close(parts, finished=False, interrupted=lambda: False)


def test_tls_settings_are_refused_when_incomplete_unreadable_or_the_key_is_not_private(tmp_path: Path) -> None:
    files = _tls_files(tmp_path)
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        ps_config(tmp_path, port=free_port(), tls_cert=str(files["cert"]))
    with pytest.raises(ValueError, match="tls_client_ca needs tls_cert"):
        ps_config(tmp_path, port=free_port(), tls_client_ca=str(files["ca"]))
    files["key"].chmod(0o644)
    port = free_port()
    with pytest.raises(ConfigError, match="tls_key .* is open to other users .*chmod 600"):
        MetricsEndpoint(ps_config(tmp_path, port=port, tls_cert=str(files["cert"]), tls_key=str(files["key"]))).start()
    files["key"].chmod(0o600)
    with pytest.raises(ConfigError, match="cannot use \\[metrics\\] tls_cert"):  # a key that is not the cert's
        MetricsEndpoint(ps_config(tmp_path, port=port, tls_cert=str(files["cert"]),
                                  tls_key=str(files["client_key"]))).start()
    with pytest.raises(ConfigError, match="tls_client_ca .* is not a file"):
        MetricsEndpoint(ps_config(tmp_path, port=port, tls_cert=str(files["cert"]), tls_key=str(files["key"]),
                                  tls_client_ca=str(tmp_path / "missing.crt"))).start()
    with socket.socket() as probe:  # nothing was left listening by the refusals
        probe.bind(("127.0.0.1", port))


def test_relative_tls_paths_are_relative_to_the_config_file(tmp_path: Path) -> None:
    from ps_daemon.config import load_daemon_config

    (tmp_path / "conf").mkdir()
    config = tmp_path / "conf" / "ps.toml"
    config.write_text('run_id = "r1"\nsites = ["site-a", "site-b"]\nrounds = 2\ncredentials = "ps.toml"\n'
                      '[model]\nname = "mlp"\nargs = {in_features = 3}\n'
                      '[metrics]\nport = 9464\ntls_cert = "tls/ps.crt"\ntls_key = "tls/ps.key"\n')
    loaded = load_daemon_config(config).metrics
    assert loaded.tls_cert == tmp_path / "conf" / "tls" / "ps.crt"
    assert loaded.tls_key == tmp_path / "conf" / "tls" / "ps.key" and loaded.tls_client_ca is None
