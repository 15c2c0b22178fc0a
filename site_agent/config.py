"""SiteConfig: what a hospital's IT writes once (site id, credentials, data location)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fedmqtt.config_io import load_toml
from fedmqtt.data.spec import DataSpec
from fedmqtt.transport.settings import BrokerSettings, load_credentials
from fedmqtt.transport.signing import KEY_LIST_FILE, Identity, load_identity
from schemas.base import ID_PATTERN
from site_agent.policy import PrivacyPolicy


class SiteConfig(BaseModel):
    """Relative paths are resolved against the config file's folder."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    site_id: str = Field(pattern=ID_PATTERN, description="this site's id: also its broker user name")
    run_id: str = Field(pattern=ID_PATTERN, description="the run to take part in (the PS config's run_id)")
    credentials: Path = Field(description="TOML file with this site's own [broker] table")
    state_dir: Path = Field(description="where the agent keeps its uplink payloads and local state")
    data: DataSpec = Field(description="where this site's data is and how to read it (docs/data-preparation.md)")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="where to train: auto = CUDA when "
                                                   "available, else CPU")
    amp: Literal["auto", "off", "bf16"] = Field(
        default="auto", description="mixed precision on CUDA: auto = bfloat16 where the GPU supports it; never on CPU")
    threads: int = Field(default=1, ge=1, le=256, description="CPU threads for torch")
    share_label_histogram: bool = Field(default=False, description="egress policy: may label counts leave the site")
    feature_statistics: Literal["site", "federated"] = Field(
        default="site", description="\"site\": standardise inputs with this site's own training statistics; "
        "\"federated\": send the PS this site's feature summary (sums, no patient-level value) and train only "
        "once the federation's statistics (ps/features) have arrived, standardised with them; the PS config's "
        "feature_statistics must say the same")
    privacy: PrivacyPolicy = Field(default=PrivacyPolicy(), description="this site's privacy policy, enforced before "
                                   "it trains (docs/privacy.md)")

    def broker_settings(self) -> BrokerSettings:
        return load_credentials(self.credentials)

    def identity(self) -> Identity:
        """This site's signing key and key list (the credentials' [signing] table); the newest key list it accepts
        is kept in state_dir, so a restart never falls back to an older one."""
        return load_identity(self.credentials, run_id=self.run_id, store=self.state_dir / KEY_LIST_FILE)


def load_site_config(path: Path) -> SiteConfig:
    cfg = load_toml(path, SiteConfig)
    base = Path(path).resolve().parent

    def resolve(p: Path) -> Path:
        return p if p.is_absolute() else base / p

    return cfg.model_copy(update={
        "credentials": resolve(cfg.credentials), "state_dir": resolve(cfg.state_dir), "data": cfg.data.resolved(base),
    })
