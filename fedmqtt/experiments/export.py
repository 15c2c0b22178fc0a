"""Export a grid point as the configs of a real deployment (PS, sites) over MQTT."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedmqtt.experiments.grid import GridPoint
    from fedmqtt.simulation import SimulationConfig


def role_configs(cfg: SimulationConfig, *, fed_dir: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The PS config and one site config per site for running `cfg` over MQTT with `fed_dir`'s credentials."""
    from fedmqtt.errors import ConfigError
    from fedmqtt.experiments.grid import SIMULATION_ONLY

    if cfg.algorithm in SIMULATION_ONLY:
        raise ConfigError(f"{cfg.algorithm} is a simulation-only baseline (no federation to deploy)")
    if cfg.pretrain_fraction is not None and cfg.pretrained is None:
        made = cfg.out_dir / "pretrained.safetensors"
        if not made.is_file():
            raise ConfigError(f"{cfg.algorithm} pretrains in simulation (pretrain_fraction): simulate this point "
                              f"once, then export again to use {made}")
        cfg = cfg.model_copy(update={"pretrained": made})
    creds = Path(fed_dir).resolve() / "credentials"
    ps = cfg.daemon_config().model_dump(mode="json", exclude_none=True)
    ps.update(credentials=str(creds / "ps.toml"), out_dir=str(cfg.out_dir / "mqtt" / "ps"))
    sites = {s.site_id: {**s.model_dump(mode="json", exclude_none=True),
                         "credentials": str(creds / f"{s.site_id}.toml"),
                         "state_dir": str(cfg.out_dir / "mqtt" / "state" / s.site_id), "device": "auto"}
             for s in cfg.site_configs()}
    return ps, sites


def to_toml(data: Mapping[str, Any], prefix: str = "") -> str:
    """Nested dicts of plain values as TOML (None left out; dicts inside lists as inline tables)."""
    plain = [f"{_key(k)} = {_value(v)}" for k, v in data.items() if v is not None and not isinstance(v, Mapping)]
    blocks = ["\n".join(plain)]
    for key, table in ((k, v) for k, v in data.items() if isinstance(v, Mapping)):
        name = f"{prefix}.{_key(key)}" if prefix else _key(key)
        inner = to_toml(table, name).rstrip("\n")
        # A table holding only tables needs no header of its own: theirs carry the full dotted name.
        own = not table or any(v is not None and not isinstance(v, Mapping) for v in table.values())
        blocks.append(f"[{name}]\n{inner}".rstrip("\n") if own else inner)
    return "\n\n".join(b for b in blocks if b) + "\n"


def _key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + "}"
    return json.dumps(str(value), ensure_ascii=False)  # JSON string escapes are valid TOML


def export_point(point: GridPoint, out_dir: Path, *, fed_dir: Path) -> Path:
    """Write `out_dir/configs/<run>/`: simulation.toml, and ps.toml + sites/<id>.toml where possible.

    Returns:
        The folder written. The MQTT configs are left out (with a note file) when the point cannot be
        deployed yet (see `role_configs`).
    """
    from fedmqtt.errors import FedMqttError
    from fedmqtt.experiments.grid import point_to_simulation_config

    cfg = point_to_simulation_config(point, out_dir)
    folder = Path(out_dir) / "configs" / point.name
    (folder / "sites").mkdir(parents=True, exist_ok=True)
    (folder / "simulation.toml").write_text(to_toml(cfg.model_dump(mode="json", exclude_none=True)))
    try:
        ps, sites = role_configs(cfg, fed_dir=fed_dir)
    except FedMqttError as exc:
        (folder / "NOT-EXPORTED.txt").write_text(f"ps.toml and sites/ not written: {exc}\n")
        return folder
    (folder / "ps.toml").write_text(to_toml(ps))
    for site, site_cfg in sites.items():
        (folder / "sites" / f"{site}.toml").write_text(to_toml(site_cfg))
    return folder
