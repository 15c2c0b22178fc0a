"""Which Host names the dashboard answers to (DNS rebinding): parsing and the allow-list, pure."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fedmqtt.dashboard.hosts import AllowedHosts, allowed_hosts, host_of
from fedmqtt.errors import ConfigError


@pytest.mark.parametrize(("header", "name"), [
    ("localhost:8765", "localhost"), ("LocalHost.", "localhost"), ("127.0.0.1", "127.0.0.1"),
    ("[::1]:8765", "::1"), ("[0:0::1]", "::1"), ("dash.example.org:443", "dash.example.org"), ("host:", "host"),
    ("", None), ("::1", None), ("[::1", None), ("[::1]x", None), ("a b", None), ("evil.example:80:80", None),
    ("evil.example:8o", None), ("-bad.example", None), ("a..b", None), ("x" * 64 + ".example", None),
])
def test_host_headers_are_parsed_strictly(header: str, name: str | None) -> None:
    assert host_of(header) == name


def test_a_loopback_dashboard_answers_to_loopback_names_and_the_extra_ones_only() -> None:
    allowed = allowed_hosts("127.0.0.1", extra=["dash.internal"])
    for own in ("127.0.0.1:8765", "localhost", "[::1]:1", "dash.internal:443", "DASH.internal."):
        assert allowed.allows(own), own
    for foreign in ("evil.example:8765", "127.0.0.1.evil.example", "127.0.0.2", "[::2]", "0.0.0.0", None, ""):
        assert not allowed.allows(foreign), foreign


def test_a_network_dashboard_answers_to_its_names_and_its_certificates(tmp_path: Path) -> None:
    cert = _certificate(tmp_path, ["dash.hospital.example", "*.proxy.example"], ["10.0.0.5"])
    allowed = allowed_hosts("10.0.0.9", names=["dash"], certificate=cert)
    for own in ("10.0.0.9:8765", "dash", "dash.hospital.example", "10.0.0.5", "a.proxy.example"):
        assert allowed.allows(own), own
    for foreign in ("localhost", "127.0.0.1", "proxy.example", "a.b.proxy.example", "evil.example"):
        assert not allowed.allows(foreign), foreign
    everywhere = allowed_hosts("0.0.0.0", names=["dash.example"])  # every address, loopback among them
    assert everywhere.allows("localhost") and everywhere.allows("dash.example") and not everywhere.allows("0.0.0.0")


def test_a_malformed_extra_name_is_refused_at_start() -> None:
    for bad in ("dash.example:8765", "http://dash.example", "a b", "*"):
        with pytest.raises(ConfigError, match="not a host name"):
            AllowedHosts.of([bad])


def _certificate(tmp: Path, dns: list[str], ips: list[str]) -> Path:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dash")])
    now = dt.datetime.now(dt.timezone.utc)
    sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False).sign(key, hashes.SHA256()))
    path = tmp / "dash.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path
