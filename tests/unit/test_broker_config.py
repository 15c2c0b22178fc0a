"""Rendering a federation's mosquitto.conf from the base file."""

from __future__ import annotations

import datetime as dt
import ipaddress
import socket
from pathlib import Path

import pytest
from cryptography import x509

from broker import certs
from broker.bridge import BridgeFlow
from broker.config import (
    CONNECTION_HEADROOM,
    Listener,
    TlsFiles,
    base_config_path,
    connection_limit,
    free_port,
    render_broker_config,
)
from broker.federation import add_site, init_federation, is_loopback, remove_site
from fedmqtt.errors import ConfigError


def _directives(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_rendered_config_appends_federation_lines(tmp_path: Path) -> None:
    """Listener, password file, ACL, persistence dir (trailing slash) and log file follow the base file."""
    # Prepare
    paths = {
        "password_file": tmp_path / "passwd",
        "acl_file": tmp_path / "acl",
        "persistence_dir": tmp_path / "data",
    }

    # Execute
    text = render_broker_config(port=18999, log_file=tmp_path / "mosquitto.log", user="fed", **paths)

    # Assert
    lines = _directives(text)
    assert lines[-7:] == [
        "listener 18999 127.0.0.1",
        "use_username_as_clientid true",
        f"password_file {tmp_path / 'passwd'}",
        f"acl_file {tmp_path / 'acl'}",
        f"persistence_location {tmp_path / 'data'}/",
        f"log_dest file {tmp_path / 'mosquitto.log'}",
        "user fed",
    ]
    assert text.index("# federation-specific") > text.index("allow_anonymous false")


def test_rendered_config_keeps_the_base_settings(tmp_path: Path) -> None:
    """Security, size, queue and persistence settings of the base file survive rendering unchanged."""
    # Prepare
    base = _directives(base_config_path().read_text(encoding="utf-8"))

    # Execute
    text = render_broker_config(
        port=1883, password_file=tmp_path / "p", acl_file=tmp_path / "a", persistence_dir=tmp_path / "d"
    )

    # Assert
    lines = _directives(text)
    assert lines[: len(base)] == base
    for setting in (
        "allow_anonymous false",
        "per_listener_settings false",
        "persistence true",
        "max_packet_size 12648448",
        "message_size_limit 12582912",
        "max_queued_messages 1000",
        "persistent_client_expiration 7d",
        "retain_available true",
    ):
        assert setting in lines
    assert "log_dest stdout" in lines  # no log file given


def test_base_config_leaves_per_federation_directives_out() -> None:
    """The base file has no listener, auth-file or persistence-location lines: the renderer owns them."""
    # Execute
    keys = {line.split()[0] for line in _directives(base_config_path().read_text(encoding="utf-8"))}

    # Assert
    assert not keys & {
        "listener",
        "port",
        "password_file",
        "acl_file",
        "persistence_location",
        "log_dest",
        "user",
    }


def test_free_port_is_bindable() -> None:
    """free_port returns a port that can be bound right away on loopback."""
    # Execute
    port = free_port()

    # Assert
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_tls_listener_block_names_its_files_and_requires_a_cert_under_mtls(tmp_path: Path) -> None:
    """Each listener's own options follow its `listener` line; TLS floor 1.2; mTLS adds the certificate
    requirement and the CRL; the loopback plain listener has no TLS lines."""
    tls = TlsFiles(tmp_path / "ca.crt", tmp_path / "s.crt", tmp_path / "s.key", require_certificate=True,
                   crlfile=tmp_path / "crl.pem")
    text = render_broker_config(
        listeners=[Listener(8883, "10.1.2.3", tls), Listener(1883, "127.0.0.1")],
        password_file=tmp_path / "p", acl_file=tmp_path / "a", persistence_dir=tmp_path / "d", user="fed",
    )
    lines = _directives(text)
    start = lines.index("listener 8883 10.1.2.3")
    assert lines[start : start + 9] == [
        "listener 8883 10.1.2.3",
        "use_username_as_clientid true",
        f"cafile {tmp_path / 'ca.crt'}",
        f"certfile {tmp_path / 's.crt'}",
        f"keyfile {tmp_path / 's.key'}",
        "tls_version tlsv1.2",
        "require_certificate true",
        f"crlfile {tmp_path / 'crl.pem'}",
        "listener 1883 127.0.0.1",
    ]
    assert "use_identity_as_username true" not in lines


def test_base_config_is_found_as_package_data() -> None:
    """broker/mosquitto.conf (a link in a checkout, a copy in the wheel) has the top-level file's content."""
    here = Path(__file__).resolve().parents[2]
    assert base_config_path().read_bytes() == (here / "mosquitto.conf").read_bytes()
    assert (here / "broker" / "mosquitto.conf").is_file()


def test_server_certificate_covers_every_name_and_is_signed_by_the_ca() -> None:
    ca = certs.create_ca("test CA")
    server = certs.issue_server_cert(ca, ["broker.example.org", "10.0.0.5", "::1", "broker.example.org"])
    cert = x509.load_pem_x509_certificate(server.cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["broker.example.org"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("::1")]
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.cert_pem))
    assert cert.not_valid_after_utc - cert.not_valid_before_utc <= dt.timedelta(days=certs.LEAF_DAYS, minutes=5)
    certs.check_server_cert(server.cert_pem, ca.cert_pem, ["broker.example.org", "10.0.0.5"])
    with pytest.raises(ConfigError, match="does not cover"):
        certs.check_server_cert(server.cert_pem, ca.cert_pem, ["other.example.org"])
    with pytest.raises(ConfigError, match="not by the CA given"):
        certs.check_server_cert(server.cert_pem, certs.create_ca("another").cert_pem, ["10.0.0.5"])


def test_fingerprint_matches_openssl_format_and_crl_accumulates() -> None:
    ca = certs.create_ca("test CA")
    fp = certs.fingerprint_sha256(ca.cert_pem)
    assert len(fp.split(":")) == 32 and fp == fp.upper()
    one, two = certs.issue_client_cert(ca, "site-a"), certs.issue_client_cert(ca, "site-b")
    crl = x509.load_pem_x509_crl(certs.revoke(ca, certs.revoke(ca, None, one.cert_pem), two.cert_pem))
    serials = {entry.serial_number for entry in crl}
    assert serials == {x509.load_pem_x509_certificate(c.cert_pem).serial_number for c in (one, two)}


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                                ("10.0.0.5", False), ("broker.example.org", False)])
def test_loopback_detection(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_network_host_gets_tls_unless_plaintext_is_asked_for_loudly(tmp_path: Path) -> None:
    """No plain listener on a network address by accident: TLS by default, --no-tls alone is refused."""
    layout = init_federation(tmp_path / "a", run_id="r", site_ids=["s"], host="10.0.0.5", names=["b.example.org"])
    assert layout.tls and layout.port == 8883 and layout.plain_port is not None
    assert [(li.host, li.tls) for li in layout.listeners()] == [("10.0.0.5", True), ("127.0.0.1", False)]
    with pytest.raises(ConfigError, match="--insecure-plaintext"):
        init_federation(tmp_path / "b", run_id="r", site_ids=["s"], host="10.0.0.5", tls=False)
    plain = init_federation(tmp_path / "c", run_id="r", site_ids=["s"], host="10.0.0.5", port=18830,
                            insecure_plaintext=True)
    assert not plain.tls and plain.listeners()[0].describe() == "10.0.0.5:18830 (plain TCP, no TLS)"
    demo = init_federation(tmp_path / "d", run_id="r", site_ids=["s"])  # loopback stays plain, as before
    assert not demo.tls and demo.plain_port is None


def test_bridge_flow_grows_with_the_model() -> None:
    """Queues on the hospital broker hold a model, a task and an update twice over; in-flight window above the
    central broker's, so the hospital never answers the central with quota exceeded."""
    small, big = BridgeFlow.for_model(10**6, 2 * 2**20), BridgeFlow.for_model(2 * 10**9, 2 * 2**20)
    assert small.max_queued_messages >= 1000 and small.max_queued_bytes >= 256 * 2**20
    assert big.max_queued_bytes >= 6 * 2 * 10**9
    assert big.max_queued_messages >= 6 * (2 * 10**9 // (2 * 2**20))
    assert small.max_inflight_messages > 20


def test_connection_limit_counts_every_login_twice_plus_headroom() -> None:
    """max_connections = 2 x (PS 2 + observer 9 + 2 per site) + CONNECTION_HEADROOM: every login may reconnect
    while its old socket is still open, and a few sites may be added before the broker restarts."""
    assert connection_limit(2) == 2 * (2 + 9 + 2 * 2) + CONNECTION_HEADROOM == 62
    assert connection_limit(500) == 2 * (2 + 9 + 2 * 500) + CONNECTION_HEADROOM
    assert connection_limit(3) - connection_limit(2) == 4


def test_every_listener_gets_the_connection_limit_and_add_site_raises_it(tmp_path: Path) -> None:
    """The limit follows each `listener` line (it is a per-listener setting); add-site and remove-site rewrite it
    for the broker's next start, since Mosquitto does not re-read it on SIGHUP."""
    # Prepare
    layout = init_federation(tmp_path / "fed", run_id="r", site_ids=["a", "b"], tls=True)

    # Execute
    before = _directives(layout.conf_path.read_text(encoding="utf-8"))
    grown, _ = add_site(layout, "c")
    after_add = _directives(layout.conf_path.read_text(encoding="utf-8"))
    remove_site(grown, "a")
    after_remove = _directives(layout.conf_path.read_text(encoding="utf-8"))

    # Assert
    listeners = [i for i, line in enumerate(before) if line.startswith("listener ")]
    assert len(listeners) == 2
    limits = [i for i, line in enumerate(before) if line.startswith("max_connections ")]
    assert len(limits) == 2 and all(before[i] == f"max_connections {connection_limit(2)}" for i in limits)
    for listener, limit in zip(listeners, limits, strict=True):  # each inside its own listener block
        assert listener < limit < min([x for x in listeners if x > listener] or [len(before)])
    assert [line for line in after_add if line.startswith("max_connections ")] == \
        [f"max_connections {connection_limit(3)}"] * 2
    assert [line for line in after_remove if line.startswith("max_connections ")] == \
        [f"max_connections {connection_limit(2)}"] * 2
    assert [ln for ln in after_add if not ln.startswith("max_connections ")] == \
        [ln for ln in before if not ln.startswith("max_connections ")]


def test_keepalive_is_capped_by_the_base_config() -> None:
    assert "max_keepalive 3600" in _directives(base_config_path().read_text(encoding="utf-8"))
