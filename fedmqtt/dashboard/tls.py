"""HTTPS for the dashboard: a server certificate from the dashboard's own CA, or the operator's own.

The certificate lives in `<federation>/dashboard/` next to the password hash. It is issued again when the
names asked for are not all in it, when it expires within 30 days, or when its CA changed.

The dashboard's CA is its own (`<federation>/dashboard/ca.crt`), never the federation's: the dashboard often
serves the broker's host name, and a certificate from the CA the parties trust, for that name, would let the
dashboard (or whoever holds its key) stand in for the broker and receive a site's password. Browsers trust the
dashboard's CA; no party does. Its certificates also carry the dashboard role (broker/certs.py), which a site
refuses even where an operator's own CA issued both.
"""

from __future__ import annotations

import datetime as dt
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from broker import certs
from fedmqtt.errors import ConfigError
from fedmqtt.transport.broker_identity import DASHBOARD_ROLE, roles

RENEW_BEFORE = dt.timedelta(days=30)


def dashboard_dir(fed_dir: Path) -> Path:
    return Path(fed_dir) / "dashboard"


def _signing_ca(fed_dir: Path) -> tuple[certs.KeyPair, Path]:
    """The dashboard's own CA (made once), whatever CA the federation's broker has."""
    own = dashboard_dir(fed_dir)
    crt, key = own / "ca.crt", own / "ca.key"
    if not (crt.is_file() and key.is_file()):
        own.mkdir(parents=True, exist_ok=True, mode=0o700)
        ca = certs.create_ca("fedmqtt dashboard CA")
        certs.write_private(key, ca.key_pem)
        crt.write_bytes(ca.cert_pem)
    return certs.KeyPair(crt.read_bytes(), key.read_bytes()), crt


def _still_good(cert_path: Path, ca_pem: bytes, names: list[str]) -> bool:
    try:
        certs.check_server_cert(cert_path.read_bytes(), ca_pem, names)
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert.verify_directly_issued_by(ca)  # the same CA key, not only the same name
    except (OSError, ValueError, TypeError, ConfigError, InvalidSignature):
        return False
    if DASHBOARD_ROLE not in roles(cert):  # issued before certificates carried their role
        return False
    return cert.not_valid_after_utc - dt.datetime.now(dt.timezone.utc) > RENEW_BEFORE


def federation_certificate(fed_dir: Path, names: list[str]) -> tuple[Path, Path, Path]:
    """(certificate, key, CA certificate) for serving the dashboard under `names` (host names, addresses)."""
    if not names:
        raise ConfigError("the dashboard certificate needs at least one host name or address")
    ca, ca_path = _signing_ca(fed_dir)
    out = dashboard_dir(fed_dir)
    cert_path, key_path = out / "server.crt", out / "server.key"
    if not (key_path.is_file() and _still_good(cert_path, ca.cert_pem, names)):
        out.mkdir(parents=True, exist_ok=True, mode=0o700)
        pair = certs.issue_server_cert(ca, names, role="dashboard")
        certs.write_private(key_path, pair.key_pem)
        cert_path.write_bytes(pair.cert_pem)
    return cert_path, key_path, ca_path


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """TLS 1.2+ with Python's default server ciphers; a bad pair fails here, at start, not at the first visit."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot use the dashboard certificate {cert} with key {key}: {exc}") from None
    return context
