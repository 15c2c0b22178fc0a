"""Lay out one federation on disk: broker config, password file, ACL, and a credentials file per party."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from broker.acl import render_acl
from broker.config import free_port, render_broker_config
from broker.passwords import generate_password, write_password_file
from fedmqtt.config_io import dump_toml, load_toml
from fedmqtt.errors import BrokerError, ConfigError
from fedmqtt.transport.settings import BrokerSettings
from fedmqtt.transport.topics import validate_id

PS_USER = "ps"
OBSERVER_USER = "observer"
FEDERATION_FILE = "federation.toml"
_MANAGED = (FEDERATION_FILE, "broker", "credentials")  # what init writes, and all that force removes


class _FederationFile(BaseModel):
    """`federation.toml`: what `load_federation` needs to rebuild the layout."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    host: str
    port: int = Field(ge=1, le=65535)
    site_ids: list[str]


@dataclass(frozen=True)
class FederationLayout:
    """Where one federation's files are, and how each party reaches the broker."""

    fed_dir: Path
    run_id: str
    site_ids: tuple[str, ...]
    host: str
    port: int
    conf_path: Path
    credentials: dict[str, Path]

    @property
    def broker_dir(self) -> Path:
        return self.fed_dir / "broker"

    @property
    def log_path(self) -> Path:
        return self.broker_dir / "mosquitto.log"

    def settings(self, user: str) -> BrokerSettings:
        """The `[broker]` settings of `user` (ps, observer or a site id) from its credentials file."""
        if user not in self.credentials:
            raise ConfigError(
                f"no broker user {user!r} in federation {self.fed_dir}; have {sorted(self.credentials)}"
            )
        return load_toml(self.credentials[user], BrokerSettings, section="broker")


def init_federation(
    fed_dir: Path,
    *,
    run_id: str,
    site_ids: list[str],
    host: str = "127.0.0.1",
    port: int | None = None,
    force: bool = False,
) -> FederationLayout:
    """Create broker config, ACL, password file and per-user credentials for one run under `fed_dir`."""
    fed_dir = Path(fed_dir).resolve()
    users = _check_ids(run_id, site_ids)
    existing = [name for name in _MANAGED if (fed_dir / name).exists()]
    if existing and not force:
        raise BrokerError(
            f"{fed_dir} already holds a federation ({', '.join(existing)}); pass force to replace it"
        )
    for name in existing:
        target = fed_dir / name
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
    port = port if port is not None else free_port(host)
    layout = _layout(fed_dir, run_id=run_id, site_ids=users[2:], host=host, port=port)
    _write_broker_files(layout)
    passwords = {user: generate_password() for user in users}
    write_password_file(layout.broker_dir / "passwd", passwords)
    _write_credentials(layout, passwords)
    meta = _FederationFile(run_id=run_id, host=host, port=port, site_ids=list(layout.site_ids))
    (fed_dir / FEDERATION_FILE).write_text(dump_toml(meta.model_dump()), encoding="utf-8")
    return layout


def load_federation(fed_dir: Path) -> FederationLayout:
    """The layout that `init_federation` wrote to `fed_dir`."""
    fed_dir = Path(fed_dir).resolve()
    meta = load_toml(fed_dir / FEDERATION_FILE, _FederationFile)
    _check_ids(meta.run_id, meta.site_ids)
    return _layout(
        fed_dir, run_id=meta.run_id, site_ids=sorted(meta.site_ids), host=meta.host, port=meta.port
    )


def _check_ids(run_id: str, site_ids: list[str]) -> list[str]:
    """Validate ids and return every broker user: ps, observer, then the sorted site ids."""
    validate_id(run_id, what="run id")
    sites = sorted(validate_id(site, what="site id") for site in site_ids)
    if not sites:
        raise ConfigError("a federation needs at least one site id")
    if len(set(sites)) != len(sites):
        raise ConfigError(f"duplicate site ids in {site_ids}")
    reserved = {PS_USER, OBSERVER_USER} & set(sites)
    if reserved:
        raise ConfigError(
            f"site ids may not be {sorted(reserved)}: those names are the PS and observer users"
        )
    return [PS_USER, OBSERVER_USER, *sites]


def _layout(fed_dir: Path, *, run_id: str, site_ids: list[str], host: str, port: int) -> FederationLayout:
    users = [PS_USER, OBSERVER_USER, *site_ids]
    return FederationLayout(
        fed_dir=fed_dir,
        run_id=run_id,
        site_ids=tuple(site_ids),
        host=host,
        port=port,
        conf_path=fed_dir / "broker" / "mosquitto.conf",
        credentials={user: fed_dir / "credentials" / f"{user}.toml" for user in users},
    )


def _write_broker_files(layout: FederationLayout) -> None:
    data_dir = layout.broker_dir / "data"
    data_dir.mkdir(parents=True, mode=0o700)
    acl_path = layout.broker_dir / "acl"
    acl_path.write_text(render_acl(layout.run_id, list(layout.site_ids)), encoding="utf-8")
    conf = render_broker_config(
        port=layout.port,
        host=layout.host,
        password_file=layout.broker_dir / "passwd",
        acl_file=acl_path,
        persistence_dir=data_dir,
        log_file=layout.log_path,
    )
    layout.conf_path.write_text(conf, encoding="utf-8")


def _write_credentials(layout: FederationLayout, passwords: dict[str, str]) -> None:
    cred_dir = layout.fed_dir / "credentials"
    cred_dir.mkdir(mode=0o700)
    for user, path in layout.credentials.items():
        table = {"host": layout.host, "port": layout.port, "username": user, "password": passwords[user]}
        BrokerSettings.model_validate(table)  # fail here, not when a party first loads its file
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(dump_toml({"broker": table}))
