"""TLS on a real Mosquitto: server-authenticated and mutual TLS listeners written by `broker init`, the ways a
party can get TLS wrong (wrong CA, wrong host name, wrong password, plain client, no client cert), and a real TLS
server with another role's certificate for the broker's name, which must not get a site's password."""

from __future__ import annotations

import contextlib
import gc
import secrets
import socket
import ssl
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from broker import certs
from broker.config import broker_user, free_port
from broker.federation import FederationLayout, init_federation, load_federation
from broker.process import BrokerProcess
from fedmqtt.dashboard import tls
from fedmqtt.errors import BrokerError, PermanentBrokerError
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


# -- is it the broker? A certificate for the broker's name from another role must get no password --------------


@contextlib.contextmanager
def _impostor(cert: bytes, key: bytes, tmp: Path) -> Iterator[tuple[int, Callable[[], bytes]]]:
    """A real TLS server (`openssl s_server`) on a free loopback port with `cert` (its chain after it) and `key`.
    Yields the port and a function returning everything the server printed, which includes every byte a client
    sent it after the handshake (an MQTT CONNECT would carry the password)."""
    tmp.mkdir(parents=True, exist_ok=True)
    certs_found = x509.load_pem_x509_certificates(cert)
    leaf, chain = tmp / "leaf.pem", tmp / "chain.pem"
    leaf.write_bytes(certs_found[0].public_bytes(serialization.Encoding.PEM))
    chain.write_bytes(b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs_found[1:]) or cert)
    key_path = tmp / "key.pem"
    key_path.write_bytes(key)
    key_path.chmod(0o600)
    port = free_port()
    out = tmp / "s_server.out"
    with out.open("wb") as sink:
        # stdin stays open: s_server stops at end of input
        server = subprocess.Popen(["openssl", "s_server", "-accept", f"127.0.0.1:{port}", "-cert", str(leaf),
                                   "-cert_chain", str(chain), "-key", str(key_path)],
                                  stdin=subprocess.PIPE, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, out.read_bytes()
                time.sleep(0.05)
        yield port, out.read_bytes
    finally:
        server.kill()
        server.wait()
        assert server.stdin is not None
        server.stdin.close()


def _site_at(layout: FederationLayout, port: int, **update: object) -> BrokerSettings:
    """site-a's own credentials, pointed at `port` (as if its traffic to the broker's name went elsewhere)."""
    return layout.settings("site-a").model_copy(update={"port": port, **update})


def _refused_before_the_password(settings: BrokerSettings, printed: Callable[[], bytes], why: str) -> None:
    """Both ways a party connects (the transport, and paho's own handshake) end in the TLS handshake, and the
    server never receives the password."""
    with pytest.raises(PermanentBrokerError, match=why):
        MqttTransport(settings, client_id="site-a").connect(timeout_s=10)
    outcome = _connack(settings, context=settings.ssl_context(), timeout_s=3.0)
    assert isinstance(outcome, ssl.SSLError), outcome
    time.sleep(0.3)
    assert settings.password.encode() not in printed()
    assert b"MQTT" not in printed()  # no CONNECT at all


def test_the_dashboard_certificate_on_the_brokers_name_gets_no_password(tls_fed: FederationLayout,
                                                                         tmp_path: Path) -> None:
    """The dashboard's certificate for the broker's own names, served by a real TLS server where the site expects
    the broker: the site refuses in the handshake. (Before, the dashboard's certificate came from the parties' CA
    and the site sent its password.)"""
    cert_path, key_path, dashboard_ca = tls.federation_certificate(tls_fed.fed_dir, list(tls_fed.names))
    assert dashboard_ca.read_bytes() != tls_fed.ca_path.read_bytes()
    with _impostor(cert_path.read_bytes(), key_path.read_bytes(), tmp_path / "impostor") as (port, printed):
        _refused_before_the_password(_site_at(tls_fed, port), printed, "not signed by the CA")


def test_a_federation_certificate_with_another_key_is_refused_by_the_pin(tls_fed: FederationLayout,
                                                                         tmp_path: Path) -> None:
    """Even a certificate from the federation's own issuing CA, for the broker's names and with serverAuth (a
    stolen issuing key, a certificate handed to another service), is not the broker's: the pinned key decides."""
    d = tls_fed.broker_dir
    issuing = certs.KeyPair((d / "issuing-ca.crt").read_bytes(), (d / "issuing-ca.key").read_bytes())
    other = certs.issue_server_cert(issuing, list(tls_fed.names))
    with _impostor(other.cert_pem + issuing.cert_pem, other.key_pem, tmp_path / "impostor") as (port, printed):
        _refused_before_the_password(_site_at(tls_fed, port), printed, "not the broker's key pinned")
    # A site holding no pin still refuses a certificate marked as the dashboard's (an operator's own CA issuing
    # both roles)
    marked = certs.issue_server_cert(issuing, list(tls_fed.names), role="dashboard")
    with _impostor(marked.cert_pem + issuing.cert_pem, marked.key_pem, tmp_path / "marked") as (port, printed):
        _refused_before_the_password(_site_at(tls_fed, port, tls_broker_key_sha256=None), printed,
                                     "the dashboard's, not the broker's")


def test_credentials_pin_the_broker_key_that_start_prints(tls_fed: FederationLayout) -> None:
    """Every party's file pins the key of server.crt, which connects (the control case for the refusals above)."""
    pin = tls_fed.broker_key_fingerprint()
    assert pin is not None and len(pin.split(":")) == 32
    for user in tls_fed.credentials:
        assert tls_fed.settings(user).tls_broker_key_sha256 == pin
    settings = tls_fed.settings("site-a")
    assert _connack(settings, context=settings.ssl_context()) == 0


def test_the_broker_runs_as_an_unprivileged_user(tls_fed: FederationLayout) -> None:
    """Started by root or not, the running mosquitto's real and effective user ids are not 0."""
    pid = int(subprocess.run(["pgrep", "-f", str(tls_fed.conf_path)], capture_output=True, text=True,
                             check=True).stdout.split()[0])
    uids = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:"))
    assert all(int(uid) != 0 for uid in uids.split()[1:]), uids
    assert f"user {broker_user()}" in tls_fed.conf_path.read_text()


def test_another_partys_client_certificate_cannot_serve_as_the_broker(tmp_path: Path) -> None:
    """Under --mtls every site holds a certificate of the federation and its key. site-b serving its own (chain
    included) where site-a expects the broker gets no password, with the pin and without it: the certificate is
    for clients only (clientAuth) and names a user, not the broker's host."""
    layout = _init(tmp_path / "fed", mtls=True)
    b = layout.settings("site-b")
    assert b.tls_cert_pem is not None and b.tls_key_pem is not None
    issuing = (layout.broker_dir / "issuing-ca.crt").read_bytes()
    with _impostor(b.tls_cert_pem.encode() + issuing, b.tls_key_pem.encode(), tmp_path / "site-b") as (port, printed):
        for pin in (layout.broker_key_fingerprint(), None):
            _refused_before_the_password(_site_at(layout, port, tls_broker_key_sha256=pin), printed,
                                         "unsuitable certificate purpose")


@contextlib.contextmanager
def _recording_relay(port: int) -> Iterator[tuple[int, Callable[[], bytes]]]:
    """A TCP relay on a free loopback port to 127.0.0.1:`port` (a port forward, or whoever watches the network):
    yields its port and a function returning every byte a client sent through it."""
    server = socket.create_server(("127.0.0.1", 0))
    sent = bytearray()
    sockets: list[socket.socket] = []

    def pump(src: socket.socket, dst: socket.socket, record: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if record:
                    sent.extend(data)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = server.accept()
                upstream = socket.create_connection(("127.0.0.1", port))
                sockets.extend((client, upstream))
                threading.Thread(target=pump, args=(client, upstream, True), daemon=True).start()
                threading.Thread(target=pump, args=(upstream, client, False), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server.getsockname()[1], lambda: bytes(sent)
    finally:
        server.close()
        for sock in sockets:
            sock.close()


@pytest.mark.parametrize("plaintext", [False, True], ids=["default", "insecure-plaintext"])
def test_a_network_name_on_a_loopback_bind_gets_tls_and_no_password_crosses_in_clear(
        mosquitto_bin: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plaintext: bool) -> None:
    """`fedmqtt broker init --host broker.example.org --bind 127.0.0.1` (a broker behind a port forward): the
    site's connection to that name reaches the loopback listener through a relay that records what it sends (the
    name resolves to 127.0.0.1 here). By default the listener and the site's credentials are TLS and the
    password is nowhere in the bytes. Before, this wrote a plain listener and credentials without a CA and the
    password crossed in clear, as it still does when --insecure-plaintext asks for it (which shows the relay
    would see it)."""
    # Prepare: the federation written by the CLI, its broker running
    fed = tmp_path / "fed"
    ports = ["--port", str(free_port())] + ([] if plaintext else ["--tls-port", str(free_port())])
    init = subprocess.run([sys.executable, "-m", "fedmqtt", "broker", "init", "--dir", str(fed), "--run-id", "fwd",
                           "--site", "site-a", "--host", "broker.example.org", "--bind", "127.0.0.1", *ports,
                           *(["--insecure-plaintext"] if plaintext else [])],
                          capture_output=True, text=True, timeout=60)
    assert init.returncode == 0, init.stdout + init.stderr
    layout = load_federation(fed)
    real_getaddrinfo = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *args, **kw: real_getaddrinfo(
        "127.0.0.1" if host == "broker.example.org" else host, *args, **kw))
    with BrokerProcess.start(layout.conf_path, port=layout.port, host=layout.listen_host), \
            _recording_relay(layout.port) as (relay_port, recorded):
        settings = layout.settings("site-a").model_copy(update={"port": relay_port})
        # Execute
        transport = MqttTransport(settings, client_id="site-a").connect(timeout_s=10)
        transport.close()
        sent = recorded()

    # Assert
    assert settings.host == "broker.example.org"
    assert [li.tls for li in layout.listeners()] == ([False] if plaintext else [True, False])
    assert (settings.tls_ca_pem is not None, settings.tls_broker_key_sha256 is not None) == (not plaintext,) * 2
    assert b"MQTT" in sent if plaintext else sent[:1] == b"\x16"  # a CONNECT in clear, or a TLS handshake record
    assert (settings.password.encode() in sent) is plaintext
