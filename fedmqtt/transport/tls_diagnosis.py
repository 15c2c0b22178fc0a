"""Why a TLS connection to the broker fails, and what to change: such failures never heal by retrying.

paho says little about a failed handshake (and leaks its socket), so the connection first handshakes once with
a socket of its own (`probe_tls`) and turns what went wrong into a message with cause and fix.
"""

from __future__ import annotations

import socket
import ssl
import sys
from dataclasses import dataclass
from typing import TypeGuard

from fedmqtt.transport.settings import BrokerSettings


class HandshakeReset(ConnectionError):
    """The peer closed the connection on our TLS ClientHello (a plain listener does that)."""


@dataclass(frozen=True)
class TlsPeer:
    """What a successful handshake showed: for `fedmqtt site check` to report."""

    version: str  # "TLSv1.3"
    cipher: str
    certificate: bytes  # the broker's certificate (DER)


def probe_tls(context: ssl.SSLContext, host: str, port: int, *, timeout_s: float = 10.0) -> TlsPeer:
    """Handshake once with our own socket before paho connects: paho leaks the socket of a failed handshake,
    and a refused client certificate (TLS 1.3) only shows as an alert after the handshake, which paho would
    see as a dropped connection and retry for ever. Raises ssl.SSLError (permanent), HandshakeReset (a plain
    listener, or a broker restarting) or another OSError (retry)."""
    with socket.create_connection((host, port), timeout=timeout_s) as raw:
        try:
            with context.wrap_socket(raw, server_hostname=host) as tls:
                cipher = tls.cipher()
                peer = TlsPeer(tls.version() or "", cipher[0] if cipher else "",
                               tls.getpeercert(binary_form=True) or b"")
                tls.settimeout(0.3)
                try:
                    tls.recv(1)  # the broker says nothing before CONNECT, unless it refuses our certificate
                except TimeoutError:
                    pass
        except (ConnectionResetError, ssl.SSLEOFError, BrokenPipeError) as exc:
            raise HandshakeReset() from exc
    return peer


def _is_broker_identity_error(exc: BaseException) -> TypeGuard[ssl.SSLCertVerificationError]:
    """A refused broker key (fedmqtt.transport.broker_identity). That module (with cryptography's x509, about 20 ms
    of CPU) is loaded by the TLS context that raises such errors, so it is not imported here: a process without
    TLS, or one that has not connected yet, does not pay for it, and without it no such error can exist."""
    identity = sys.modules.get("fedmqtt.transport.broker_identity")
    return identity is not None and isinstance(exc, identity.BrokerIdentityError)


def explain_tls(exc: ssl.SSLError, *, broker: str, settings: BrokerSettings) -> str:
    """Cause and fix of a failed TLS handshake (these never heal by retrying)."""
    cause, fix = diagnose_tls(exc, broker=broker, settings=settings)
    if _is_broker_identity_error(exc):
        return f"{cause} {fix}"
    return f"{cause}; {fix[0].lower()}{fix[1:-1]}."


def diagnose_tls(exc: ssl.SSLError, *, broker: str, settings: BrokerSettings) -> tuple[str, str]:
    """(cause, fix) of a failed TLS handshake, the fix a sentence of its own (what `explain_tls` joins)."""
    if _is_broker_identity_error(exc):
        return (f"TLS: the server at {broker} is not the federation's broker: {exc.verify_message}. Nothing was "
                "sent to it.",
                "Check that host and port in the [broker] settings point at the broker (not at the dashboard or "
                "another service on that host); if the broker's key was replaced on purpose, ask its operator for "
                "this party's new credentials file (`fedmqtt broker rotate`).")
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = str(exc.verify_message or exc)
        lower = why.lower()
        if "hostname mismatch" in lower or "ip address mismatch" in lower:
            fix = (f"the broker's certificate is not issued for {settings.host!r}: set host in the [broker] "
                   f"settings to a name the certificate lists (its subjectAltName), or reissue the certificate")
        elif "expired" in lower:
            fix = "the broker's certificate has expired: reissue it (and restart the broker)"
        elif "not yet valid" in lower:
            fix = "the broker's certificate is not valid yet: check the clocks of both machines"
        elif "issuer" in lower or "self-signed" in lower or "self signed" in lower:
            fix = ("the broker's certificate is not signed by the CA of the [broker] settings (tls_ca_pem or "
                   "tls_ca_file): use the federation's CA certificate (the credentials file `fedmqtt broker init` "
                   "wrote carries it)")
        else:
            fix = "check the CA of the [broker] settings (tls_ca_pem or tls_ca_file) and the broker's certificate"
        return f"TLS certificate verify failed for the broker {broker}: {why}", _sentence(fix)
    text = str(exc)
    if isinstance(exc, ssl.SSLEOFError) or "wrong version number" in text.lower() or "record" in text.lower():
        fix = (f"is {broker} a TLS listener? Remove tls_ca_pem/tls_ca_file from the [broker] settings for a "
               f"plain listener, or use the broker's TLS port")
    elif "certificate required" in text.lower() or "unknown ca" in text.lower() or "bad certificate" in text.lower():
        fix = ("the broker wants a client certificate it trusts (mutual TLS): set tls_cert_pem/tls_key_pem (or "
               "tls_cert_file/tls_key_file) to this party's certificate from `fedmqtt broker init --mtls`")
    else:
        fix = "check the TLS settings (tls_ca_*, tls_cert_*, tls_key_*) against the broker's listener"
    return f"TLS handshake with the broker {broker} failed: {text}", _sentence(fix)


def _sentence(text: str) -> str:
    return f"{text[0].upper()}{text[1:]}."


def explain_handshake_reset(broker: str, cause: BaseException | None) -> str:
    """The broker closed the connection during our TLS handshake, again and again: a plain listener."""
    return (f"the broker {broker} closed the connection during the TLS handshake ({cause}): is it a TLS "
            "listener? Remove tls_ca_pem/tls_ca_file from the [broker] settings for a plain listener, or use the "
            "broker's TLS port.")


def explain_silent_closes(broker: str, closes: int) -> str:
    """The broker closed a plaintext connection `closes` times without a CONNACK: a TLS listener."""
    return (f"the broker {broker} closed the connection {closes} times without answering CONNECT: is it a TLS "
            "listener? Set tls_ca_pem or tls_ca_file in the [broker] settings for a TLS port, or use the broker's "
            "plain port.")
