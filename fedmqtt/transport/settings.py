"""How to reach the broker: the `[broker]` table of every credentials and role config file."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class BrokerSettings(BaseModel):
    """Broker address and this party's own credentials (each site has its own user)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=1883, ge=1, le=65535)
    username: str
    password: str = Field(min_length=1, repr=False)
    keepalive_s: int = Field(default=30, ge=5, le=3600)
    tls_ca_file: Path | None = None  # set for a TLS listener (production); None on loopback
    max_payload_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
