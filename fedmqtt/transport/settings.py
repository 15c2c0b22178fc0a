"""How to reach the broker: the `[broker]` table of every credentials and role config file."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.chunks import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES

if TYPE_CHECKING:
    import ssl


class BrokerSettings(BaseModel):
    """Broker address and this party's own credentials (each site has its own user)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(default="127.0.0.1", description="the broker's host name or address (for TLS: the name "
                      "its certificate was issued for)")
    port: int = Field(default=1883, ge=1, le=65535, description="the broker's MQTT port")
    username: str = Field(description="this party's broker user: `ps`, `observer` or the site id")
    password: str = Field(min_length=1, repr=False, description="this party's broker password (written by "
                          "`fedmqtt broker init`)")
    keepalive_s: int = Field(default=30, ge=5, le=3600, description="MQTT keepalive: the broker declares a silent "
                             "client lost (and fires its Last Will) after 1.5 times this")
    tls_ca_file: Path | None = Field(default=None, description="CA certificate (PEM) to verify the broker "
                                     "against; set for a TLS listener, unset on loopback")
    # Mutual TLS: this party's client certificate and key (PEM), issued by the federation's CA. The broker
    # requires one on top of the password (`broker init --mtls`; the CRL revokes it on rotate/remove-site).
    tls_cert_file: Path | None = Field(default=None, description="mutual TLS: this party's client certificate "
                                       "(PEM), issued by the federation's CA")
    tls_key_file: Path | None = Field(default=None, description="mutual TLS: the key of tls_cert_file (PEM)")
    # The same three as PEM text inside the credentials file, so a party gets one file to keep (`broker init`
    # writes these; the *_file forms are for certificates an operator brings).
    tls_ca_pem: str | None = Field(default=None, repr=False, description="tls_ca_file's content as PEM text")
    tls_cert_pem: str | None = Field(default=None, repr=False, description="tls_cert_file's content as PEM text")
    tls_key_pem: str | None = Field(default=None, repr=False, description="tls_key_file's content as PEM text")
    # Mutual TLS where the certificate is the identity (`broker init --mtls`): every simultaneous connection of
    # a party logs in as its own user (`<user>.bulk`, observer seats; broker/acl.py), so it needs a certificate
    # naming that user. They share the key of tls_key_pem.
    tls_seat_certs_pem: str | None = Field(default=None, repr=False, description="mutual TLS: the client "
                                           "certificates (PEM, one after another) of this party's other logins "
                                           "(`<user>.bulk`, `observer.1` ...), for the key of tls_key_pem")
    tls_broker_key_sha256: str | None = Field(default=None, pattern=r"^([0-9A-Fa-f]{2}:){31}[0-9A-Fa-f]{2}$",
                                              description="SHA-256 of the broker certificate's public key "
                                              "(colon-separated hex, as `fedmqtt broker start` prints it): the TLS "
                                              "handshake is refused, before the password is sent, unless the server "
                                              "shows this key")
    # Largest message after reassembly (a 512 MB model fits); the broker's own per-packet cap is far lower
    # (mosquitto.conf) because anything above `chunk_threshold_bytes` travels as chunks.
    max_payload_bytes: int = Field(default=1024 * 1024 * 1024, ge=1024, description="largest message this party "
                                   "sends or accepts, after reassembly of its chunks")
    chunk_threshold_bytes: int = Field(default=4 * 1024 * 1024, ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES,
                                       description="an encoded message larger than this travels as chunks "
                                       "(docs/protocol.md, \"Chunked transfer\")")
    chunk_bytes: int = Field(default=2 * 1024 * 1024, ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES,
                             description="size of each chunk this party sends (the last one may be shorter)")
    # A receiver asks for at most this many chunk bytes at a time: keep it under max_queued_bytes.
    fetch_window_bytes: int = Field(default=64 * 1024 * 1024, ge=MIN_CHUNK_BYTES, description="chunk bytes a "
                                    "receiver asks the broker for at once; keep it under the broker's "
                                    "max_queued_bytes")
    chunk_stall_s: float = Field(default=10.0, gt=0, description="no chunk for this long: fetch the missing "
                                 "ones again")
    chunk_refetches: int = Field(default=3, ge=0, description="re-fetches before a transfer is given up, naming "
                                 "the missing chunks")
    # Receiver budgets, per sender, set here and never by what a manifest declares: the declared bytes and the
    # number of chunked transfers one party may have queued or in progress at this receiver (a sender needs
    # at most one per topic it writes), and the slowest transfer rate tolerated before the single fetch slot
    # is handed on (one party must not hold it for ever by trickling chunks).
    max_pending_chunk_bytes: int = Field(default=2 * 1024 * 1024 * 1024, ge=MIN_CHUNK_BYTES,
                                         description="receiver budget per sender: bytes its queued and active "
                                         "chunked transfers may declare in all")
    max_pending_manifests: int = Field(default=64, ge=1, le=100_000, description="receiver budget per sender: "
                                       "chunked transfers queued or in progress")
    chunk_min_rate_bytes_per_s: float = Field(default=32 * 1024, gt=0, allow_inf_nan=False,
                                              description="a chunked transfer slower than this is given up, so "
                                              "one sender cannot hold the single fetch slot for ever")

    @model_validator(mode="after")
    def _tls_consistent(self) -> BrokerSettings:
        if self.tls_ca_file is not None and self.tls_ca_pem is not None:
            raise ValueError("give the CA as tls_ca_file or as tls_ca_pem, not both")
        has_cert = self.tls_cert_file is not None or self.tls_cert_pem is not None
        has_key = self.tls_key_file is not None or self.tls_key_pem is not None
        if has_cert != has_key:
            raise ValueError("a client certificate needs its key and a key needs its certificate")
        if (self.tls_cert_file is not None and self.tls_cert_pem is not None) or (
            self.tls_key_file is not None and self.tls_key_pem is not None
        ):
            raise ValueError("give the client certificate and key as files or as PEM text, not both")
        if has_cert and not self.tls:
            raise ValueError("a client certificate needs TLS: set tls_ca_file or tls_ca_pem")
        if self.tls_seat_certs_pem is not None and self.tls_key_pem is None:
            raise ValueError("tls_seat_certs_pem needs the key they were issued for in tls_key_pem")
        if self.tls_broker_key_sha256 is not None and not self.tls:
            raise ValueError("tls_broker_key_sha256 needs TLS: set tls_ca_file or tls_ca_pem")
        return self

    @property
    def tls(self) -> bool:
        """True when this party connects with TLS (a CA to verify the broker against is configured)."""
        return self.tls_ca_file is not None or self.tls_ca_pem is not None

    def ssl_context(self, seat: str | None = None) -> ssl.SSLContext | None:
        """A client TLS context that verifies the broker (CA, host name, and its pinned key or role: see
        fedmqtt.transport.broker_identity) and presents the client certificate for mutual TLS (the one of
        `<username>.<seat>` when the credentials carry it); None without TLS. Inline PEM keys pass through a
        0600 temporary file for the time of `load_cert_chain` only (Python's ssl loads keys from files)."""
        import os
        import tempfile

        from fedmqtt.transport.broker_identity import BrokerContext

        if not self.tls:
            return None
        ctx = BrokerContext.create(self.tls_broker_key_sha256)  # CERT_REQUIRED and check_hostname on
        if self.tls_ca_pem is not None:
            ctx.load_verify_locations(cadata=self.tls_ca_pem)
        else:
            ctx.load_verify_locations(cafile=str(self.tls_ca_file))
        if self.tls_cert_file is not None and self.tls_key_file is not None:
            ctx.load_cert_chain(str(self.tls_cert_file), str(self.tls_key_file))
        elif self.tls_cert_pem is not None and self.tls_key_pem is not None:
            cert_pem = self.seat_cert(seat) or self.tls_cert_pem
            with tempfile.TemporaryDirectory(prefix="fedmqtt-tls-") as tmp:  # 0700, removed at once
                path = os.path.join(tmp, "client.pem")
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w", encoding="ascii") as f:
                    f.write(cert_pem.strip() + "\n" + self.tls_key_pem.strip() + "\n")
                ctx.load_cert_chain(path)
        return ctx

    def seat_cert(self, seat: str | None) -> str | None:
        """The certificate (PEM) among tls_seat_certs_pem whose common name is `<username>.<seat>`, if any."""
        if seat is None or self.tls_seat_certs_pem is None:
            return None
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.x509.oid import NameOID

        wanted = f"{self.username}.{seat}"
        for cert in x509.load_pem_x509_certificates(self.tls_seat_certs_pem.encode("ascii")):
            names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
            if names and names[-1].value == wanted:
                return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")
        return None


def check_private(path: Path) -> None:
    """Refuse a secrets file (password, client key) that others on the machine can read or change.

    Refused rather than warned about: a warning scrolls by while the password stays readable by every local
    account, and anyone who read it can log in as this party. The fix is one command."""
    import stat

    from fedmqtt.errors import ConfigError

    mode = Path(path).stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        who = " and ".join(w for w, bits in (("its group", stat.S_IRWXG), ("other users", stat.S_IRWXO))
                           if mode & bits)
        raise ConfigError(f"{path} holds this party's broker credentials and is open to {who} (mode "
                          f"{stat.S_IMODE(mode):04o}); make it private with: chmod 600 {path}")


def load_credentials(path: Path) -> BrokerSettings:
    """The `[broker]` table of a party's credentials file, which must be private (check_private)."""
    from fedmqtt.config_io import load_toml

    path = Path(path)
    if path.is_file():  # a missing file: load_toml says so, naming it
        check_private(path)
    return load_toml(path, BrokerSettings, section="broker")
