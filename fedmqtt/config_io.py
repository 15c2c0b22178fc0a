"""Load TOML config files into pydantic models with errors that name the file and the field."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TypeVar

# Other modules take `tomllib` from here, so the version switch is written once per package that needs it.
if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as a package (the `tomli` dependency)
    import tomli as tomllib

from pydantic import BaseModel, ValidationError

from fedmqtt.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def read_toml(path: Path) -> dict[str, object]:
    """The TOML file at `path` as a dict, or ConfigError naming the file (missing, or not valid TOML)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def load_toml(path: Path, model: type[M], *, section: str | None = None) -> M:
    """Parse `path` (optionally one table of it) into `model`, or raise ConfigError naming what is wrong."""
    data = read_toml(path)
    if section is None:
        return validate_config(data, model, source=str(path))
    if section not in data:
        raise ConfigError(f"{path}: missing [{section}] table")
    return validate_config(data[section], model, source=str(path))


def validate_config(data: object, model: type[M], *, source: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"  {where}: {err['msg']}")
        raise ConfigError(f"{source}: invalid configuration:\n" + "\n".join(lines)) from None


def dump_toml(data: dict[str, object]) -> str:
    """Write a flat-or-nested dict of simple values as TOML (enough for the files we generate)."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    out = [f"{k} = {_toml_value(v)}" for k, v in scalars.items()]
    for name, table in tables.items():
        out.append("")
        out.append(f"[{name}]")
        out.extend(f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict))
        for sub, subtable in ((k, v) for k, v in table.items() if isinstance(v, dict)):
            out.append("")
            out.append(f"[{name}.{sub}]")
            out.extend(f"{k} = {_toml_value(v)}" for k, v in subtable.items())
    return "\n".join(out) + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if value is None:
        raise ValueError("TOML has no null")
    return json.dumps(str(value), ensure_ascii=False)  # JSON string escapes are valid TOML
