"""How to reach the broker: the `[broker]` table of every credentials and role config file."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from schemas.chunks import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES


class BrokerSettings(BaseModel):
    """Broker address and this party's own credentials (each site has its own user)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=1883, ge=1, le=65535)
    username: str
    password: str = Field(min_length=1, repr=False)
    keepalive_s: int = Field(default=30, ge=5, le=3600)
    tls_ca_file: Path | None = None  # set for a TLS listener (production); None on loopback
    # Mutual TLS: this party's client certificate and key (PEM). The broker then takes the user name from the
    # certificate (use_identity_as_username) and `password` is not sent.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # Largest message after reassembly (a 512 MB model fits); the broker's own per-packet cap is far lower
    # (mosquitto.conf) because anything above `chunk_threshold_bytes` travels as chunks.
    max_payload_bytes: int = Field(default=1024 * 1024 * 1024, ge=1024)
    chunk_threshold_bytes: int = Field(default=4 * 1024 * 1024, ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES)
    chunk_bytes: int = Field(default=2 * 1024 * 1024, ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES)
    # A receiver asks for at most this many chunk bytes at a time: keep it under max_queued_bytes.
    fetch_window_bytes: int = Field(default=64 * 1024 * 1024, ge=MIN_CHUNK_BYTES)
    chunk_stall_s: float = Field(default=10.0, gt=0)  # no chunk for this long: fetch the missing ones again
    chunk_refetches: int = Field(default=3, ge=0)  # then give up on the transfer, naming the missing chunks
    # Receiver budgets, per sender, set here and never by what a manifest declares: the declared bytes and the
    # number of chunked transfers one party may have queued or in progress at this receiver (a sender needs
    # at most one per topic it writes), and the slowest transfer rate tolerated before the single fetch slot
    # is handed on (one party must not hold it for ever by trickling chunks).
    max_pending_chunk_bytes: int = Field(default=2 * 1024 * 1024 * 1024, ge=MIN_CHUNK_BYTES)
    max_pending_manifests: int = Field(default=64, ge=1, le=100_000)
    chunk_min_rate_bytes_per_s: float = Field(default=32 * 1024, gt=0, allow_inf_nan=False)
