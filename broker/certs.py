"""A federation's private CA, the broker's server certificate and per-party client certificates (cryptography).

Keys are ECDSA P-256: small, fast handshakes, and accepted by every OpenSSL that Mosquitto and Python link.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedmqtt.errors import ConfigError

CA_DAYS = 3650
LEAF_DAYS = 825  # the most browsers and most corporate TLS policies accept for a leaf certificate


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, both PEM."""

    cert_pem: bytes
    key_pem: bytes


def create_ca(common_name: str) -> KeyPair:
    """A self-signed CA that may sign only leaf certificates (path length 0)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # tolerate a little clock skew between hosts
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue_server_cert(ca: KeyPair, names: list[str]) -> KeyPair:
    """A server certificate whose subject alternative names are `names` (host names and IP addresses)."""
    if not names:
        raise ConfigError("a server certificate needs at least one host name or address")
    sans = [_san(n) for n in dict.fromkeys(names)]
    return _issue(ca, names[0], sans, ExtendedKeyUsageOID.SERVER_AUTH)


def issue_client_cert(ca: KeyPair, user: str) -> KeyPair:
    """A client certificate whose common name is the MQTT user name (use_identity_as_username)."""
    return _issue(ca, user, [], ExtendedKeyUsageOID.CLIENT_AUTH)


def revoke(ca: KeyPair, crl_pem: bytes | None, cert_pem: bytes | None) -> bytes:
    """A CRL signed by `ca` listing what `crl_pem` listed plus `cert_pem` (None: nothing new), as PEM."""
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError("the federation CA key is not an EC key")
    now = _now()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now - dt.timedelta(minutes=5))
        .next_update(now + dt.timedelta(days=CA_DAYS))  # no CRL distribution: it is valid until replaced
    )
    if crl_pem is not None:
        for entry in x509.load_pem_x509_crl(crl_pem):
            builder = builder.add_revoked_certificate(entry)
    if cert_pem is not None:
        serial = x509.load_pem_x509_certificate(cert_pem).serial_number
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
        )
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def fingerprint_sha256(cert_pem: bytes) -> str:
    """SHA-256 of the DER certificate as colon-separated hex, as `openssl x509 -fingerprint -sha256` prints it."""
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


def check_server_cert(cert_pem: bytes, ca_pem: bytes, names: list[str]) -> None:
    """Refuse an operator's own certificate that the parties would reject: wrong issuer, expired, SAN missing."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    ca = x509.load_pem_x509_certificate(ca_pem)
    if cert.issuer != ca.subject:
        raise ConfigError(f"the server certificate is issued by {cert.issuer.rfc4514_string()}, "
                          f"not by the CA given ({ca.subject.rfc4514_string()})")
    if cert.not_valid_after_utc <= _now():
        raise ConfigError(f"the server certificate expired on {cert.not_valid_after_utc:%Y-%m-%d}")
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise ConfigError("the server certificate has no subject alternative names; clients check those") from None
    have = set(san.get_values_for_type(x509.DNSName)) | {str(a) for a in san.get_values_for_type(x509.IPAddress)}
    missing = [n for n in names if n not in have]
    if missing:
        raise ConfigError(f"the server certificate does not cover {missing} (it names {sorted(have)}); "
                          "parties connecting by those names would fail the host name check")


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to a new file readable only by its owner (keys, credentials)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a reader never sees half a key


def _issue(ca: KeyPair, common_name: str, sans: list[x509.GeneralName], usage: x509.ObjectIdentifier) -> KeyPair:
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError("the federation CA key is not an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=LEAF_DAYS), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)
