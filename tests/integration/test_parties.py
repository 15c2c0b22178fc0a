"""One party at a time on a running broker: `broker add-site`, `rotate` and `remove-site` change that party only,
and the broker started by `broker start` reloads (SIGHUP) so the change takes effect without a restart."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from broker.config import connection_limit
from broker.federation import FederationLayout, init_federation, load_federation
from fedmqtt.transport.settings import BrokerSettings


def _fedmqtt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedmqtt", *args], capture_output=True, text=True, timeout=60,
                          check=True)


@pytest.fixture
def running(mosquitto_bin: str, tmp_path: Path) -> Iterator[FederationLayout]:
    """A mutual-TLS federation on loopback whose broker runs under `fedmqtt broker start` (it writes the pid file)."""
    layout = init_federation(tmp_path / "fed", run_id="parties", site_ids=["site-a", "site-b"], host="127.0.0.1",
                             tls=True, mtls=True)
    proc = subprocess.Popen([sys.executable, "-m", "fedmqtt", "broker", "start", "--dir", str(layout.fed_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while not layout.pid_path.is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.1)
        yield layout
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=15)
        print(out)


def _code(settings: BrokerSettings, *, seat: str | None = None) -> int | None:
    """CONNACK reason code over TLS (0 = accepted), or None when the handshake or connection failed; `seat`: with
    the certificate of that login (`<user>.<seat>`)."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="", protocol=mqtt.MQTTv5)
    client.username_pw_set(settings.username, settings.password)
    client.tls_set_context(settings.ssl_context(seat=seat))
    got: list[int] = []
    done = threading.Event()
    client.on_connect = lambda _c, _u, _f, reason, _p: (got.append(reason.value), done.set())
    try:
        client.connect(settings.host, settings.port, keepalive=10)
    except OSError as exc:  # ssl.SSLError too: paho leaves that socket unclosed, collect it quietly here
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            exc.__traceback__ = None  # its frames hold the socket
            gc.collect()
        return None
    client.loop_start()
    done.wait(5)
    client.disconnect()
    client.loop_stop()
    return got[0] if got else None


def _reloaded(layout: FederationLayout) -> None:
    """Mosquitto logs each SIGHUP; wait for it so the next connect sees the new files."""
    deadline = time.monotonic() + 10
    while "Reloading config" not in layout.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, "broker did not log a reload"
        time.sleep(0.1)


def test_start_prints_listeners_and_ca_fingerprint(running: FederationLayout) -> None:
    out = _fedmqtt("broker", "init", "--dir", str(running.fed_dir.parent / "again"), "--run-id", "x",
                   "--site", "a", "--tls").stdout
    assert "(TLS)" in out and "(plain TCP, no TLS)" in out and "CA SHA-256" in out


def test_add_rotate_remove_on_a_running_broker(running: FederationLayout) -> None:
    fed = str(running.fed_dir)
    before_b = running.credentials["site-b"].read_bytes()
    old_a = running.settings("site-a")
    assert _code(old_a) == 0

    # add-site: the new hospital gets in; nobody else's file changes
    out = _fedmqtt("broker", "add-site", "--dir", fed, "--site", "site-c").stdout
    assert "reloads" in out
    _reloaded(running)
    layout = load_federation(running.fed_dir)
    assert layout.site_ids == ("site-a", "site-b", "site-c")
    assert layout.credentials["site-c"].stat().st_mode & 0o777 == 0o600
    assert _code(layout.settings("site-c")) == 0
    assert running.credentials["site-b"].read_bytes() == before_b
    # max_connections (not re-read on SIGHUP) is raised for the next start; until then its headroom lets site-c in
    limits = [ln for ln in running.conf_path.read_text(encoding="utf-8").splitlines() if ln.startswith("max_conn")]
    assert limits == [f"max_connections {connection_limit(3)}"] * 2  # the TLS and the loopback listener

    # rotate site-a: new password and certificates; under mutual TLS the certificate is the login, so the new one
    # gets in and the old one, on the CRL, does not (whatever password comes with it); site-b untouched
    log_size = running.log_path.stat().st_size
    _fedmqtt("broker", "rotate", "--dir", fed, "--party", "site-a")
    _wait_new_reload(running, log_size)
    new_a = layout.settings("site-a")
    assert new_a.password != old_a.password and new_a.tls_cert_pem != old_a.tls_cert_pem
    assert new_a.tls_seat_certs_pem != old_a.tls_seat_certs_pem
    assert _code(new_a) == 0
    assert _code(layout.settings("site-b")) == 0
    assert running.credentials["site-b"].read_bytes() == before_b
    # the old certificate is on the CRL: with the new password it still does not get in
    revoked_cert = new_a.model_copy(update={"tls_cert_pem": old_a.tls_cert_pem, "tls_key_pem": old_a.tls_key_pem})
    assert _code(revoked_cert) is None
    # and so is the old certificate of its bulk connection
    assert _code(old_a, seat="bulk") is None and _code(new_a, seat="bulk") == 0

    # remove-site: its credentials are gone and its login is refused
    removed = layout.settings("site-c")
    log_size = running.log_path.stat().st_size
    _fedmqtt("broker", "remove-site", "--dir", fed, "--site", "site-c")
    _wait_new_reload(running, log_size)
    assert not layout.credentials["site-c"].exists()
    assert _code(removed) in (0x86, 0x87, None)
    assert load_federation(running.fed_dir).site_ids == ("site-a", "site-b")
    assert _code(layout.settings("site-b")) == 0


def _wait_new_reload(layout: FederationLayout, offset: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        with layout.log_path.open(errors="replace") as f:
            f.seek(offset)
            if "Reloading config" in f.read():
                return
        assert time.monotonic() < deadline, "broker did not log a reload"
        time.sleep(0.1)
