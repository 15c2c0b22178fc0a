"""SiteConfig: what a hospital's IT writes once (site id, credentials, data location)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedmqtt.config_io import load_toml
from fedmqtt.transport.settings import BrokerSettings
from schemas.base import ID_PATTERN


class DataSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["heart_disease"] = "heart_disease"
    path: Path = Field(description="the site's own data file; nothing else is read")
    split_seed: int = 0
    fractions: tuple[float, float, float] = (0.6, 0.2, 0.2)

    @model_validator(mode="after")
    def _check(self) -> "DataSpec":
        if abs(sum(self.fractions) - 1.0) > 1e-6 or min(self.fractions) <= 0:
            raise ValueError(f"fractions {self.fractions} must be positive and sum to 1 (train, val, test)")
        return self


class SiteConfig(BaseModel):
    """Relative paths are resolved against the config file's folder."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    site_id: str = Field(pattern=ID_PATTERN)
    run_id: str = Field(pattern=ID_PATTERN)
    credentials: Path = Field(description="TOML file with this site's own [broker] table")
    state_dir: Path = Field(description="where the agent keeps its uplink payloads and local state")
    data: DataSpec
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int = Field(default=1, ge=1, le=256, description="CPU threads for torch")
    share_label_histogram: bool = Field(default=False, description="egress policy: may label counts leave the site")

    def broker_settings(self) -> BrokerSettings:
        return load_toml(self.credentials, BrokerSettings, section="broker")


def load_site_config(path: Path) -> SiteConfig:
    cfg = load_toml(path, SiteConfig)
    base = Path(path).resolve().parent

    def resolve(p: Path) -> Path:
        return p if p.is_absolute() else base / p

    return cfg.model_copy(update={
        "credentials": resolve(cfg.credentials), "state_dir": resolve(cfg.state_dir),
        "data": cfg.data.model_copy(update={"path": resolve(cfg.data.path)}),
    })
