"""A federation's PKI with roles (cryptography): a root CA, a name-constrained issuing CA, and leaf certificates
whose key usage and names say what each one may be.

- Root CA (`create_root_ca`): the parties' trust anchor (`ca.crt`). It signs only the issuing CA (path length
  1), so its key can leave the broker host (`broker init --export-root-key`).
- Issuing CA (`create_issuing_ca`): signs the broker's server certificate and the parties' client certificates,
  and nothing else: NameConstraints permit the federation's host names and addresses, the party namespace
  (`party_domain`) and subjects under the run's own directory name, so its key (which stays on the broker host to
  serve add-site and rotate) cannot mint a certificate for any other name.
- Leaves: the broker's is serverAuth only and carries the broker role policy; a party's is clientAuth only,
  CN = its broker user (Mosquitto's use_identity_as_username); the dashboard's is serverAuth with the dashboard
  role policy, from a CA of its own (fedmqtt/dashboard/tls.py) that no party trusts.

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
from fedmqtt.transport.broker_identity import BROKER_ROLE, DASHBOARD_ROLE, key_sha256

CA_DAYS = 3650
LEAF_DAYS = 825  # the most browsers and most corporate TLS policies accept for a leaf certificate
PARTY_DOMAIN = "fedmqtt.invalid"  # .invalid never resolves (RFC 2606): a namespace for party names only
_CA_USAGE = x509.KeyUsage(
    digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
    key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
)
_LEAF_USAGE = x509.KeyUsage(  # ECDHE handshakes sign with the leaf key; nothing else
    digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
    key_agreement=False, key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False,
)


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, both PEM."""

    cert_pem: bytes
    key_pem: bytes


def create_ca(common_name: str) -> KeyPair:
    """A self-signed CA that may sign only leaf certificates (path length 0): the dashboard's own CA, and tests."""
    return _self_signed(common_name, path_length=0)


def create_root_ca(run_id: str) -> KeyPair:
    """The federation's root: the parties' trust anchor, which signs only the issuing CA (path length 1)."""
    return _self_signed(f"fedmqtt root CA {run_id}", path_length=1)


def party_domain(run_id: str) -> str:
    """The DNS namespace of a run's party certificates: `<user>.<run_id>.fedmqtt.invalid` (see issue_client_cert)."""
    return f"{run_id}.{PARTY_DOMAIN}"


def federation_namespace(run_id: str) -> x509.Name:
    """The directory name every leaf subject of a run starts with (the issuing CA's DirectoryName constraint)."""
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedmqtt"),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, run_id)])


def create_issuing_ca(root: KeyPair, run_id: str, names: list[str]) -> KeyPair:
    """The CA that signs the broker's and the parties' certificates, limited by NameConstraints to the broker's
    names and addresses (`names`), the run's party namespace and subjects under `federation_namespace`.

    With no address among `names`, every IPv4 and IPv6 address is excluded (IP names are unconstrained
    otherwise). Path length 0: it cannot make another CA."""
    root_key, root_cert = _load(root)
    dns = [x509.DNSName(n) for n in dict.fromkeys(names) if not _is_ip(n)] + [x509.DNSName(party_domain(run_id))]
    ips = [x509.IPAddress(ipaddress.ip_network(n)) for n in dict.fromkeys(names) if _is_ip(n)]
    excluded = None if ips else [x509.IPAddress(ipaddress.ip_network("0.0.0.0/0")),
                                 x509.IPAddress(ipaddress.ip_network("::/0"))]
    permitted: list[x509.GeneralName] = [*dns, *ips, x509.DirectoryName(federation_namespace(run_id))]
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    subject = x509.Name([*federation_namespace(run_id), x509.NameAttribute(NameOID.COMMON_NAME,
                                                                           f"fedmqtt issuing CA {run_id}")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(root_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=CA_DAYS), root_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .add_extension(x509.NameConstraints(permitted_subtrees=permitted, excluded_subtrees=excluded), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(root_key.public_key()), critical=False)
        .sign(root_key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue_server_cert(ca: KeyPair, names: list[str], *, role: str = "broker") -> KeyPair:
    """A server certificate (serverAuth only) whose subject alternative names are `names` (host names and IP
    addresses), marked with its `role`: "broker" or "dashboard" (a site refuses a dashboard's certificate)."""
    if not names:
        raise ConfigError("a server certificate needs at least one host name or address")
    sans = [_san(n) for n in dict.fromkeys(names)]
    marker = {"broker": BROKER_ROLE, "dashboard": DASHBOARD_ROLE}[role]
    # The common name is no host name (it has spaces): clients match the SANs, and OpenSSL would otherwise test
    # a dotted CN against the issuing CA's DNS constraints as well.
    return _issue(ca, f"fedmqtt {role}", sans, ExtendedKeyUsageOID.SERVER_AUTH, policy=marker)


def issue_client_cert(ca: KeyPair, user: str, *, run_id: str | None = None, key_pem: bytes | None = None) -> KeyPair:
    """A client certificate (clientAuth only) whose common name is the MQTT user name (use_identity_as_username).

    `run_id`: also name the user in the run's party namespace (a DNS SAN `<user>.<run_id>.fedmqtt.invalid`),
    as the issuing CA's constraints want: without a DNS SAN, OpenSSL tests a dotted common name such as
    `site-a.bulk` against the CA's DNS constraints. `key_pem`: certify this key instead of a new one (the
    certificates of one party's logins share its key)."""
    sans: list[x509.GeneralName] = [] if run_id is None else [x509.DNSName(f"{user}.{party_domain(run_id)}")]
    return _issue(ca, user, sans, ExtendedKeyUsageOID.CLIENT_AUTH, key_pem=key_pem)


def revoke(ca: KeyPair, crl_pem: bytes | None, cert_pem: bytes | None) -> bytes:
    """A CRL signed by `ca` listing what `crl_pem` listed plus every certificate in `cert_pem` (None: nothing
    new), as PEM."""
    ca_key, ca_cert = _load(ca)
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
    for cert in x509.load_pem_x509_certificates(cert_pem) if cert_pem is not None else []:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(cert.serial_number).revocation_date(now).build()
        )
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def fingerprint_sha256(cert_pem: bytes) -> str:
    """SHA-256 of the DER certificate as colon-separated hex, as `openssl x509 -fingerprint -sha256` prints it."""
    der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


def broker_key_sha256(cert_pem: bytes) -> str:
    """SHA-256 of the public key of the (first) certificate in `cert_pem`: what parties pin for the broker."""
    return key_sha256(x509.load_pem_x509_certificate(cert_pem))


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


def _issue(
    ca: KeyPair, common_name: str, sans: list[x509.GeneralName], usage: x509.ObjectIdentifier, *,
    policy: x509.ObjectIdentifier | None = None, key_pem: bytes | None = None,
) -> KeyPair:
    ca_key, ca_cert = _load(ca)
    if key_pem is None:
        key = ec.generate_private_key(ec.SECP256R1())
    else:
        loaded = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise ConfigError("a party key is not an EC key")
        key = loaded
    now = _now()
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([*_namespace_of(ca_cert), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=LEAF_DAYS), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_LEAF_USAGE, critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if policy is not None:
        builder = builder.add_extension(x509.CertificatePolicies([x509.PolicyInformation(policy, None)]),
                                        critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _namespace_of(ca_cert: x509.Certificate) -> list[x509.NameAttribute]:
    """The directory name the CA's NameConstraints permit for subjects (none: no prefix)."""
    try:
        constraints = ca_cert.extensions.get_extension_for_class(x509.NameConstraints).value
    except x509.ExtensionNotFound:
        return []
    for name in constraints.permitted_subtrees or []:
        if isinstance(name, x509.DirectoryName):
            return list(name.value)
    return []


def _self_signed(common_name: str, *, path_length: int) -> KeyPair:
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
        .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _load(ca: KeyPair) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError("the federation CA key is not an EC key")
    return ca_key, x509.load_pem_x509_certificate(ca.cert_pem)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


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
