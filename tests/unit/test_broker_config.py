"""Rendering a federation's mosquitto.conf from the base file."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import pwd
import socket
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from broker import certs
from broker.bridge import BridgeFlow
from broker.config import (
    BROKER_SYSTEM_USER,
    CONNECTION_HEADROOM,
    Listener,
    TlsFiles,
    base_config_path,
    connection_limit,
    free_port,
    render_broker_config,
)
from broker.federation import add_site, init_federation, is_loopback, remove_site, rotate
from broker.process import prepare_for_broker_user
from fedmqtt.errors import BrokerError, ConfigError
from fedmqtt.transport.broker_identity import BROKER_ROLE, roles


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
    requirement, makes the certificate the identity (the password is then ignored) and adds the CRL; the
    loopback plain listener has no TLS lines."""
    tls = TlsFiles(tmp_path / "ca.crt", tmp_path / "s.crt", tmp_path / "s.key", require_certificate=True,
                   crlfile=tmp_path / "crl.pem")
    text = render_broker_config(
        listeners=[Listener(8883, "10.1.2.3", tls), Listener(1883, "127.0.0.1")],
        password_file=tmp_path / "p", acl_file=tmp_path / "a", persistence_dir=tmp_path / "d", user="fed",
    )
    lines = _directives(text)
    start = lines.index("listener 8883 10.1.2.3")
    assert lines[start : start + 10] == [
        "listener 8883 10.1.2.3",
        "use_username_as_clientid true",
        f"cafile {tmp_path / 'ca.crt'}",
        f"certfile {tmp_path / 's.crt'}",
        f"keyfile {tmp_path / 's.key'}",
        "tls_version tlsv1.2",
        "require_certificate true",
        "use_identity_as_username true",
        f"crlfile {tmp_path / 'crl.pem'}",
        "listener 1883 127.0.0.1",
    ]
    assert lines.count("use_identity_as_username true") == 1


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


def test_a_network_host_gets_tls_even_when_the_broker_binds_loopback(tmp_path: Path) -> None:
    """A broker bound to 127.0.0.1 behind a port forward still has its parties cross the network: TLS, and every
    credentials file carries the CA and the pinned broker key. Plain text only when asked for loudly. (Before,
    the bind address decided and this got a plain listener and credentials without a CA.)"""
    layout = init_federation(tmp_path / "a", run_id="r", site_ids=["s"], host="broker.example.org", bind="127.0.0.1")
    assert layout.tls and layout.port == 8883
    assert [(li.host, li.tls) for li in layout.listeners()] == [("127.0.0.1", True), ("127.0.0.1", False)]
    settings = layout.settings("s")
    assert settings.host == "broker.example.org" and settings.tls_ca_pem and settings.tls_broker_key_sha256
    with pytest.raises(ConfigError, match="whatever address the broker binds"):
        init_federation(tmp_path / "b", run_id="r", site_ids=["s"], host="broker.example.org", bind="127.0.0.1",
                        tls=False)
    plain = init_federation(tmp_path / "c", run_id="r", site_ids=["s"], host="broker.example.org", bind="127.0.0.1",
                            port=18831, insecure_plaintext=True)
    assert not plain.tls and plain.settings("s").tls_ca_pem is None


def _openssl_verify(tmp_path: Path, layout_dir: Path, leaf_pem: bytes, purpose: str) -> str:
    """`openssl verify` of a leaf against the root (ca.crt) with the issuing CA as the intermediate."""
    leaf = tmp_path / "leaf.pem"
    leaf.write_bytes(leaf_pem)
    done = subprocess.run(["openssl", "verify", "-CAfile", str(layout_dir / "ca.crt"), "-untrusted",
                           str(layout_dir / "issuing-ca.crt"), "-purpose", purpose, str(leaf)],
                          capture_output=True, text=True)
    return done.stdout + done.stderr


def test_the_pki_has_a_root_a_constrained_issuing_ca_and_leaves_by_role(tmp_path: Path) -> None:
    """Root (signs CAs only) -> issuing CA (NameConstraints: the federation's names, its party namespace and
    directory name) -> broker certificate (serverAuth only) and client certificates (clientAuth only, CN = user);
    OpenSSL itself refuses a leaf of the issuing CA for any other name, and each leaf for the other role."""
    layout = init_federation(tmp_path / "fed", run_id="pki", site_ids=["site-a"], host="broker.example.org",
                             mtls=True, port=free_port())
    d = layout.broker_dir
    root = x509.load_pem_x509_certificate((d / "ca.crt").read_bytes())
    issuing = x509.load_pem_x509_certificate((d / "issuing-ca.crt").read_bytes())
    assert root.extensions.get_extension_for_class(x509.BasicConstraints).value.path_length == 1
    issuing.verify_directly_issued_by(root)
    constraints = issuing.extensions.get_extension_for_class(x509.NameConstraints)
    assert constraints.critical
    permitted = constraints.value.permitted_subtrees or []
    assert {str(n.value) for n in permitted if isinstance(n, x509.DNSName)} == {"broker.example.org",
                                                                                 "pki.fedmqtt.invalid"}
    assert {str(n.value) for n in permitted if isinstance(n, x509.IPAddress)} == {"127.0.0.1/32"}
    server_pem = (d / "server.crt").read_bytes()
    server = x509.load_pem_x509_certificate(server_pem)
    assert list(server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH]
    assert roles(server) == {BROKER_ROLE}
    site = layout.settings("site-a")
    assert site.tls_cert_pem is not None and site.tls_seat_certs_pem is not None
    client = x509.load_pem_x509_certificate(site.tls_cert_pem.encode())
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "site-a"
    assert list(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH]
    seat = x509.load_pem_x509_certificates(site.tls_seat_certs_pem.encode())
    assert [c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value for c in seat] == ["site-a.bulk",
                                                                                              "site-a.check"]

    # OpenSSL builds the chains and enforces the roles and the constraints
    assert "OK" in _openssl_verify(tmp_path, d, server_pem, "sslserver")
    assert "OK" in _openssl_verify(tmp_path, d, site.tls_cert_pem.encode(), "sslclient")
    assert "OK" in _openssl_verify(tmp_path, d, site.tls_seat_certs_pem.encode(), "sslclient")
    assert "unsuitable certificate purpose" in _openssl_verify(tmp_path, d, server_pem, "sslclient")
    assert "unsuitable certificate purpose" in _openssl_verify(tmp_path, d, site.tls_cert_pem.encode(), "sslserver")
    signer = certs.KeyPair((d / "issuing-ca.crt").read_bytes(), (d / "issuing-ca.key").read_bytes())
    for name, why in (("bank.example.com", "permitted subtree violation"),
                      ("10.9.9.9", "permitted subtree violation")):
        rogue = certs.issue_server_cert(signer, [name]).cert_pem
        assert why in _openssl_verify(tmp_path, d, rogue, "sslserver"), name
    # no key that signs leaves lies next to the root's certificate but the issuing CA's
    assert (d / "root-ca.key").stat().st_mode & 0o077 == 0 and (d / "issuing-ca.key").stat().st_mode & 0o077 == 0


def test_the_root_key_can_leave_the_broker_host(tmp_path: Path) -> None:
    """--export-root-key writes the root's key to a new 0600 file and nowhere under the federation; adding and
    rotating parties need only the issuing CA."""
    exported = tmp_path / "offline" / "root.key"
    exported.parent.mkdir()
    layout = init_federation(tmp_path / "fed", run_id="off", site_ids=["a"], tls=True, mtls=True,
                             export_root_key=exported)
    assert exported.stat().st_mode & 0o777 == 0o600
    assert not layout.root_key_path.exists()
    assert not [p for p in layout.fed_dir.rglob("*") if p.is_file() and p.read_bytes() == exported.read_bytes()]
    root = x509.load_pem_x509_certificate(layout.ca_path.read_bytes())
    key = serialization.load_pem_private_key(exported.read_bytes(), password=None)
    assert key.public_key() == root.public_key()
    new, _ = add_site(layout, "b")
    rotate(new, "a")
    assert new.settings("b").tls_cert_pem and new.settings("a").tls_cert_pem
    with pytest.raises(ConfigError, match="new file"):
        init_federation(tmp_path / "again", run_id="off", site_ids=["a"], tls=True, export_root_key=exported)


def test_the_broker_user_is_never_root(tmp_path: Path) -> None:
    """The rendered config names an unprivileged user: the invoking one, or `mosquitto` when that is root; a
    config that would keep Mosquitto root is refused at start, with the fix."""
    text = render_broker_config(port=1883, password_file=tmp_path / "p", acl_file=tmp_path / "a",
                                persistence_dir=tmp_path / "d")
    user = next(line.split()[1] for line in _directives(text) if line.startswith("user "))
    assert pwd.getpwnam(user).pw_uid != 0
    assert user == (BROKER_SYSTEM_USER if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name)
    if os.geteuid() != 0:
        pytest.skip("only root can start Mosquitto as root: nothing more to refuse")
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(text.replace(f"user {user}", "user root"))
    with pytest.raises(BrokerError, match="must not.*user mosquitto"):
        prepare_for_broker_user(conf)


def test_connection_limit_counts_every_login_twice_plus_headroom() -> None:
    """max_connections = 2 x (PS 3 + observer 9 + monitor 1 + 3 per site) + CONNECTION_HEADROOM (a party's logins:
    its connection, its bulk connection and its `site check` login): every login may reconnect while its old socket
    is still open, and a few sites may be added before the broker restarts."""
    assert connection_limit(2) == 2 * (3 + 9 + 1 + 3 * 2) + CONNECTION_HEADROOM == 70
    assert connection_limit(500) == 2 * (3 + 9 + 1 + 3 * 500) + CONNECTION_HEADROOM
    assert connection_limit(3) - connection_limit(2) == 6


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
