"""TLS on a real Mosquitto: server-authenticated and mutual TLS listeners written by `broker init`, and the
ways a party can get TLS wrong (wrong CA, wrong host name, wrong password, plain client, no client cert)."""

from __future__ import annotations

import gc
import secrets
import ssl
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from broker.federation import FederationLayout, init_federation
from broker.process import BrokerProcess
from fedmqtt.errors import BrokerError
from fedmqtt.transport import topics
from fedmqtt.transport.mqtt import MqttTransport
from fedmqtt.transport.settings import BrokerSettings


def _init(tmp: Path, *, mtls: bool = False, names: list[str] | None = None) -> FederationLayout:
    return init_federation(tmp, run_id=f"t-{secrets.token_hex(3)}", site_ids=["site-a", "site-b"],
                           host="127.0.0.1", names=names if names is not None else ["localhost"],
                           tls=True, mtls=mtls)


@pytest.fixture
def tls_fed(mosquitto_bin: str, tmp_path: Path) -> Iterator[FederationLayout]:
    layout = _init(tmp_path / "fed")
    with BrokerProcess.start(layout.conf_path, port=layout.port, host=layout.listen_host):
        yield layout


@pytest.fixture
def mtls_fed(mosquitto_bin: str, tmp_path: Path) -> Iterator[FederationLayout]:
    layout = _init(tmp_path / "fed", mtls=True)
    with BrokerProcess.start(layout.conf_path, port=layout.port, host=layout.listen_host):
        yield layout


def _connack(settings: BrokerSettings, *, context: ssl.SSLContext | None, timeout_s: float = 5.0) -> object:
    """The CONNACK reason code, or the exception the TLS handshake raised, or None when nothing came back."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"t-{secrets.token_hex(3)}",
                         protocol=mqtt.MQTTv5)
    client.username_pw_set(settings.username, settings.password)
    if context is not None:
        client.tls_set_context(context)
    got: list[object] = []
    done = threading.Event()
    client.on_connect = lambda _c, _u, _f, reason, _p: (got.append(reason), done.set())
    try:
        client.connect(settings.host, settings.port, keepalive=10)
    except (ssl.SSLError, OSError) as exc:
        _collect_failed_handshake(exc)
        return exc
    client.loop_start()
    done.wait(timeout_s)
    client.disconnect()
    client.loop_stop()
    return got[0] if got else None


def _collect_failed_handshake(exc: BaseException | None = None) -> None:
    """paho drops the socket of a failed TLS handshake without closing it; collect it now, quietly, instead of
    letting its ResourceWarning land in a later test (on another pytest-xdist worker, in whichever test runs
    next). The frames of `exc`'s traceback still hold it: let go of them first."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        if exc is not None:
            exc.__traceback__ = None
        gc.collect()


def test_init_writes_one_credentials_file_with_the_ca(tls_fed: FederationLayout) -> None:
    """Every party's file is 0600 and carries the CA PEM; the broker lists a TLS and a loopback plain listener."""
    for path in tls_fed.credentials.values():
        assert path.stat().st_mode & 0o777 == 0o600
        settings = tls_fed.settings(path.stem)
        assert settings.tls_ca_pem == tls_fed.ca_path.read_text()
        assert settings.port == tls_fed.port
    kinds = [(listener.port, listener.tls) for listener in tls_fed.listeners()]
    assert kinds == [(tls_fed.port, True), (tls_fed.plain_port, False)]
    assert (tls_fed.broker_dir / "server.key").stat().st_mode & 0o777 == 0o600


def test_site_connects_over_tls_by_address_and_by_name(tls_fed: FederationLayout) -> None:
    settings = tls_fed.settings("site-a")
    assert _connack(settings, context=settings.ssl_context()) == 0
    by_name = settings.model_copy(update={"host": "localhost"})
    assert _connack(by_name, context=by_name.ssl_context()) == 0


def test_plaintext_client_gets_nothing_from_the_tls_listener(tls_fed: FederationLayout) -> None:
    settings = tls_fed.settings("site-a")
    assert _connack(settings, context=None, timeout_s=3.0) is None


def test_wrong_ca_fails_the_handshake(tls_fed: FederationLayout, tmp_path: Path) -> None:
    other = _init(tmp_path / "other")
    settings = tls_fed.settings("site-a").model_copy(update={"tls_ca_pem": other.ca_path.read_text()})
    outcome = _connack(settings, context=settings.ssl_context())
    assert isinstance(outcome, ssl.SSLCertVerificationError)
    assert "certificate verify failed" in str(outcome)


def test_host_name_missing_from_the_certificate_fails(mosquitto_bin: str, tmp_path: Path) -> None:
    layout = _init(tmp_path / "fed", names=[])  # the certificate names 127.0.0.1 only
    with BrokerProcess.start(layout.conf_path, port=layout.port, host=layout.listen_host):
        settings = layout.settings("site-a").model_copy(update={"host": "localhost"})
        outcome = _connack(settings, context=settings.ssl_context())
    assert isinstance(outcome, ssl.SSLCertVerificationError)
    assert "Hostname mismatch" in str(outcome)


def test_wrong_password_is_refused_over_tls(tls_fed: FederationLayout) -> None:
    settings = tls_fed.settings("site-a").model_copy(update={"password": "not-the-password"})
    outcome = _connack(settings, context=settings.ssl_context())
    assert getattr(outcome, "value", None) in (0x86, 0x87)  # Mosquitto 2.0.11 answers 0x87


def test_mtls_needs_the_client_certificate(mtls_fed: FederationLayout) -> None:
    settings = mtls_fed.settings("site-a")
    assert settings.tls_cert_pem is not None and settings.tls_key_pem is not None
    assert _connack(settings, context=settings.ssl_context()) == 0
    bare = settings.model_copy(update={"tls_cert_pem": None, "tls_key_pem": None})
    outcome = _connack(bare, context=bare.ssl_context(), timeout_s=3.0)
    assert outcome is None or isinstance(outcome, (ssl.SSLError, OSError)), outcome


# -- the fedmqtt client (fedmqtt/transport/mqtt.py) on these listeners ---------------------------------------


def test_transport_moves_messages_over_mtls(mtls_fed: FederationLayout) -> None:
    run = mtls_fed.run_id
    ps = MqttTransport(mtls_fed.settings("ps"), client_id="ps").connect(timeout_s=10)
    site = MqttTransport(mtls_fed.settings("site-a"), client_id="site-a").connect(timeout_s=10)
    try:
        ps.subscribe([topics.site_status_topic(run, "site-a")])
        site.publish(topics.site_status_topic(run, "site-a"), b"{}")
        message = ps.get(5.0)
        assert message is not None and message.topic == topics.site_status_topic(run, "site-a")
    finally:
        site.close()
        ps.close()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("wrong_ca", "not signed by the CA"),
        ("hostname", "not issued for 'localhost'"),
        ("password", "0x8[67]"),
    ],
)
def test_transport_fails_fast_with_the_cause(
    mosquitto_bin: str, tmp_path: Path, change: str, expected: str
) -> None:
    """Each mistake ends the connect at once (well before its 20 s timeout) with a message naming the cause."""
    layout = _init(tmp_path / "fed", names=[])
    settings = layout.settings("site-a")
    if change == "wrong_ca":
        settings = settings.model_copy(update={"tls_ca_pem": _init(tmp_path / "other").ca_path.read_text()})
    elif change == "hostname":
        settings = settings.model_copy(update={"host": "localhost"})
    else:
        settings = settings.model_copy(update={"password": "not-the-password"})
    with BrokerProcess.start(layout.conf_path, port=layout.port, host=layout.listen_host):
        transport = MqttTransport(settings, client_id="site-a")
        started = time.monotonic()
        with pytest.raises(BrokerError, match=expected):
            transport.connect(timeout_s=20)
        _collect_failed_handshake()
        assert time.monotonic() - started < 10  # fail fast, not at the timeout
