"""Can this host reach the broker, and is what answers the federation's broker? Name lookup, then a TCP
connection, then the TLS handshake the agent would make (CA, host name, pinned broker key: the same context,
`BrokerSettings.ssl_context`, and the same explanations, fedmqtt.transport.tls_diagnosis). Each way of failing
(no such name, refused, no answer, wrong CA, wrong name, wrong key) has its own finding and fix."""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import time

from cryptography import x509
from cryptography.x509.oid import NameOID

from broker.acl import CHECK_SEAT
from broker.federation import is_loopback
from fedmqtt.transport.broker_identity import key_sha256
from fedmqtt.transport.settings import BrokerSettings
from fedmqtt.transport.tls_diagnosis import HandshakeReset, diagnose_tls, explain_handshake_reset, probe_tls
from site_agent.preflight.findings import Finding, failed, passed, warned

BROKER, TLS = "broker", "TLS"
EXPIRY_WARN_DAYS = 30


def check_broker_address(settings: BrokerSettings, *, timeout_s: float) -> Finding:
    """The host name resolves and a TCP connection to host:port opens (the first address that answers wins,
    as for the agent's own connection)."""
    host, port = settings.host, settings.port
    where = "the [broker] table of the credentials file"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return failed(BROKER, f"cannot resolve {host!r}: {exc.strerror}",
                      f"Check host in {where}; `getent hosts {host}` must print an address on this machine (the "
                      "hospital's DNS, or /etc/hosts).", host=host, port=port, error="dns")
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    errors: list[tuple[str, OSError]] = []
    for address in addresses:
        start = time.perf_counter()
        try:
            with socket.create_connection((address, port), timeout=timeout_s):
                ms = (time.perf_counter() - start) * 1000
        except OSError as exc:
            errors.append((address, exc))
            continue
        named = host if host == address else f"{host} -> {address}"
        took = f"{ms:.0f} ms" if ms >= 1 else "<1 ms"
        return passed(BROKER, f"{named}: TCP port {port} open ({took})", host=host, port=port,
                      address=address, connect_ms=round(ms, 1))
    address, error = errors[0]
    facts = {"host": host, "port": port, "address": address}
    if isinstance(error, ConnectionRefusedError):
        return failed(BROKER, f"{address}:{port} refused the connection: nothing listens there",
                      f"Is the broker running (`fedmqtt broker start` on its host)? Check port in {where}: the "
                      "broker's TLS port (8883 unless `broker init` was told otherwise).", error="refused", **facts)
    if isinstance(error, TimeoutError):
        return failed(BROKER, f"no answer from {address}:{port} within {timeout_s:.0f} s",
                      f"A firewall drops the connection: allow outbound TCP from this host to {host}:{port} "
                      "(hospital firewall or proxy) and inbound on the broker's host.", error="timeout", **facts)
    return failed(BROKER, f"cannot connect to {address}:{port}: {error.strerror or error}",
                  "This host has no route to the broker: check its network, default gateway or proxy settings.",
                  error="network", **facts)


def check_tls(settings: BrokerSettings, *, timeout_s: float) -> Finding:
    """The handshake the agent makes: the CA, the broker's name and its pinned key, checked before any password
    leaves this host."""
    broker = f"{settings.host}:{settings.port}"
    if not settings.tls:
        if is_loopback(settings.host):
            return passed(TLS, "not used: the broker is on this host's loopback", tls=False)
        return warned(TLS, f"not used: the password and the models cross the network to {broker} in clear text",
                      "Ask the broker's operator for a TLS federation (`fedmqtt broker init` without "
                      "--insecure-plaintext) and its credentials file.", tls=False)
    context = settings.ssl_context(seat=CHECK_SEAT)
    assert context is not None  # settings.tls
    try:
        peer = probe_tls(context, settings.host, settings.port, timeout_s=timeout_s)
    except ssl.SSLError as exc:
        cause, fix = diagnose_tls(exc, broker=broker, settings=settings)
        return failed(TLS, cause, fix, tls=True, error=_kind(exc))
    except HandshakeReset as exc:
        return failed(TLS, f"{broker} closed the connection during the TLS handshake",
                      _sentence(explain_handshake_reset(broker, exc.__cause__).split("): ", 1)[-1]), tls=True,
                      error="reset")
    except OSError as exc:
        return failed(TLS, f"no TLS answer from {broker}: {exc}", "See the broker check above; if it passed, the "
                      "broker is overloaded or restarting: run the check again.", tls=True, error="network")
    cert = x509.load_der_x509_certificate(peer.certificate)
    days = (cert.not_valid_after_utc - dt.datetime.now(dt.timezone.utc)).days
    issuer = _common_name(cert.issuer) or cert.issuer.rfc4514_string()
    pin = "pinned broker key matches" if settings.tls_broker_key_sha256 else "no key pinned"
    found = f"{peer.version}; certificate for {settings.host!r} from {issuer}, {days} days left; {pin}"
    facts = {"tls": True, "version": peer.version, "cipher": peer.cipher, "issuer": issuer,
             "not_after": cert.not_valid_after_utc.isoformat(), "days_left": days, "broker_key_sha256":
             key_sha256(cert), "pinned": settings.tls_broker_key_sha256 is not None,
             "run_id": federation_run(cert)}
    if days < EXPIRY_WARN_DAYS:
        return warned(TLS, found, f"The broker's certificate expires in {days} days: ask its operator to renew it "
                      "before then (sites cannot connect once it has expired).", **facts)
    return passed(TLS, found, **facts)


def _kind(exc: ssl.SSLError) -> str:
    """A short name for --json: what kind of TLS failure this is."""
    from fedmqtt.transport.broker_identity import BrokerIdentityError

    if isinstance(exc, BrokerIdentityError):
        return "not_the_broker"
    why = str(getattr(exc, "verify_message", "") or exc).lower()
    if "mismatch" in why:
        return "name"
    if "issuer" in why or "self" in why:
        return "ca"
    if "expired" in why or "not yet valid" in why:
        return "validity"
    return "handshake"


def federation_run(cert: x509.Certificate) -> str | None:
    """The run a certificate from `fedmqtt broker init` belongs to: its subject starts O=fedmqtt, OU=<run id>
    (broker/certs.py, federation_namespace); None for certificates an operator brought."""
    subject = cert.subject
    org = subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    unit = subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    return str(unit[0].value) if org and org[0].value == "fedmqtt" and unit else None


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _common_name(name: x509.Name) -> str:
    values = name.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(values[-1].value) if values else ""
