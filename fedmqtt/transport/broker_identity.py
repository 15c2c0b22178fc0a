"""Is the TLS server the federation's broker? Checked inside the handshake, before MQTT sends a password.

The federation's CA vouches for names, and more than one server may hold a certificate for the broker's name
(an operator's dashboard on the same host did, and so captured a site's password). So a party also checks the
role of the certificate it is shown: the public key must be the broker's, pinned in the credentials file
(`tls_broker_key_sha256`, written by `broker init`, `add-site` and `rotate`), and a certificate marked as the
dashboard's is refused even where no pin is configured.

Role markers are certificate policy OIDs under 2.25 (ITU-T X.667: an OID made from a UUID needs no registry).
"""

from __future__ import annotations

import hashlib
import ssl

from cryptography import x509
from cryptography.hazmat.primitives import serialization

BROKER_ROLE = x509.ObjectIdentifier("2.25.103915627341442202362790367372064904452")
DASHBOARD_ROLE = x509.ObjectIdentifier("2.25.104419512339506326386088680210944244457")


class BrokerIdentityError(ssl.SSLCertVerificationError):
    """The server's certificate chains to the federation's CA but is not the broker's (wrong key or role)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.verify_message = message  # what explain_tls and callers read, as for OpenSSL's own failures
        self.verify_code = 0


def key_sha256(cert: x509.Certificate) -> str:
    """SHA-256 of the certificate's SubjectPublicKeyInfo (DER), colon-separated upper-case hex.

    The same as `openssl x509 -pubkey -noout | openssl pkey -pubin -outform DER | openssl dgst -sha256`.
    A key pin survives a reissued certificate for the same key."""
    spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return ":".join(f"{b:02X}" for b in hashlib.sha256(spki).digest())


def roles(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    """The fedmqtt role markers the certificate carries (its certificate policies)."""
    try:
        policies = cert.extensions.get_extension_for_class(x509.CertificatePolicies).value
    except x509.ExtensionNotFound:
        return set()
    return {p.policy_identifier for p in policies} & {BROKER_ROLE, DASHBOARD_ROLE}


def check_broker_certificate(cert_der: bytes | None, pin: str | None) -> None:
    """Raise BrokerIdentityError unless the server's certificate (DER) can be the broker's."""
    if cert_der is None:
        raise BrokerIdentityError("the server showed no certificate")
    cert = x509.load_der_x509_certificate(cert_der)
    if DASHBOARD_ROLE in roles(cert):
        raise BrokerIdentityError("the server's certificate is the dashboard's, not the broker's")
    if pin is not None:
        shown = key_sha256(cert)
        if _normal(shown) != _normal(pin):
            raise BrokerIdentityError(f"the server's key (SHA-256 {shown}) is not the broker's key pinned in the "
                                      f"credentials (tls_broker_key_sha256 {pin})")


def _normal(fingerprint: str) -> str:
    return fingerprint.replace(":", "").lower()


class _BrokerCheckingSocket(ssl.SSLSocket):
    """Checks the broker's identity as soon as the handshake completes: paho sends CONNECT (with the password)
    only after `do_handshake` returns, and `probe_tls` wraps with the handshake on connect, which calls this."""

    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        context = self.context
        if isinstance(context, BrokerContext):
            try:
                check_broker_certificate(self.getpeercert(binary_form=True), context.broker_key_sha256)
            except BrokerIdentityError:
                self.close()
                raise


class BrokerContext(ssl.SSLContext):
    """A client context whose sockets refuse a server that is not the broker (see check_broker_certificate)."""

    sslsocket_class = _BrokerCheckingSocket
    broker_key_sha256: str | None = None

    @classmethod
    def create(cls, broker_key_sha256: str | None) -> BrokerContext:
        """CERT_REQUIRED and host name checks on (as ssl.create_default_context), TLS 1.2 at least."""
        context = cls(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.broker_key_sha256 = broker_key_sha256
        return context
