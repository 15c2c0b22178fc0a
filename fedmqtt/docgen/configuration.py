"""docs/configuration.md: every key of every config file, made from the pydantic models that validate them.

Name, type, default and valid range come from each field (its annotation, default and constraints); the
description is the field's own `description=`. The example files are validated by the same models while the
page is rendered, so an example that stops being valid stops the build instead of misleading a reader.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from fedmqtt.config_io import tomllib
from fedmqtt.data.spec import OPTIONS, DataSpec
from fedmqtt.docgen.tables import code, size, table
from fedmqtt.simulation_config import SimulationConfig
from fedmqtt.transport.settings import BrokerSettings
from fedmqtt.transport.signing import SigningSettings
from ps_daemon.config import DaemonConfig, MetricsConfig, RecruitmentConfig
from schemas.messages import ModelSpec, RecordDP, TrainSettings
from site_agent.config import SiteConfig
from site_agent.policy import PrivacyPolicy

PATH = "docs/configuration.md"
# Models whose every field must carry a description (tests/integration/test_docs_protocol.py checks it).
DESCRIBED: tuple[type[BaseModel], ...] = (DaemonConfig, RecruitmentConfig, MetricsConfig, ModelSpec, TrainSettings,
                                          RecordDP, SiteConfig, PrivacyPolicy, BrokerSettings, SigningSettings,
                                          SimulationConfig)


# -- one field -> one row ---------------------------------------------------------------------------------
def _strip(annotation: Any) -> tuple[Any, list[Any]]:
    """The bare type of an Annotated[...] and the constraint objects it carries."""
    metadata: list[Any] = []
    while typing.get_origin(annotation) is typing.Annotated:
        annotation, *extra = typing.get_args(annotation)
        for item in extra:
            metadata.extend(item.metadata if isinstance(item, FieldInfo) else [item])
    return annotation, metadata


def type_name(annotation: Any) -> str:
    """A TOML reader's name for a Python annotation: string, integer, list of string, table, ..."""
    annotation, _ = _strip(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "string" if all(isinstance(a, str) for a in args) else "literal"
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        unique = list(dict.fromkeys(names))
        return " or ".join(unique) + (" (optional)" if type(None) in args else "")
    if origin in (tuple, list):
        inner = [a for a in args if a is not Ellipsis]
        if origin is tuple and len(inner) > 1 and Ellipsis not in args:
            return f"list of {len(inner)} {type_name(inner[0])}s"
        return f"list of {type_name(inner[0])}" if inner else "list"
    if origin is dict:
        return f"table of {type_name(args[1])}" if args else "table"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    return {str: "string", int: "integer", float: "float", bool: "boolean", Path: "path", bytes: "bytes",
            Any: "any"}.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _constraints(field: FieldInfo) -> list[tuple[Any, Any]]:
    """(constraint, the type it constrains) on the field itself and on each member of an optional or union
    type; constraints inside a list or table's items are left to the description."""
    found = [(item, _strip(field.annotation)[0]) for item in field.metadata]
    pending = [field.annotation]
    while pending:
        bare, metadata = _strip(pending.pop())
        found.extend((item, bare) for item in metadata)
        if typing.get_origin(bare) in (typing.Union, types.UnionType):
            pending.extend(typing.get_args(bare))
    return found


def valid_range(field: FieldInfo) -> str:
    """What values the model accepts, in words: bounds, lengths, patterns, choices."""
    choices = _literal_choices(field.annotation)
    if choices:
        return "one of " + ", ".join(code(json.dumps(c)) for c in choices)
    parts: list[str] = []
    for item, bare in _constraints(field):
        text = _constraint_text(item, bare)
        if text and text not in parts:
            parts.append(text)
    return "; ".join(parts) or "any"


def _literal_choices(annotation: Any) -> list[Any]:
    bare, _ = _strip(annotation)
    if typing.get_origin(bare) is typing.Literal:
        return list(typing.get_args(bare))
    return []


def _constraint_text(item: Any, bare: Any) -> str:
    bounds = ((at.Ge, "ge", ">="), (at.Gt, "gt", ">"), (at.Le, "le", "<="), (at.Lt, "lt", "<"))
    for kind, attr, sign in bounds:
        if isinstance(item, kind):
            return f"{sign} {_number(getattr(item, attr))}"
    unit = "characters" if bare is str else "entries"
    if isinstance(item, at.MinLen) and item.min_length == 1 and bare is str:
        return "not empty"
    if isinstance(item, at.MinLen):
        noun = "entry" if unit == "entries" and item.min_length == 1 else unit
        return f"at least {item.min_length} {noun}"
    if isinstance(item, at.MaxLen):
        return f"at most {item.max_length} {unit}"
    pattern = getattr(item, "pattern", None)
    if isinstance(pattern, str):
        return f"matches {code(pattern)}"
    if getattr(item, "allow_inf_nan", None) is False:
        return "finite"
    return ""


def _number(value: Any) -> str:
    """Bounds as people read them: 2^63 rather than 9223372036854775808."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and abs(value) >= 1 << 20:
        magnitude = abs(value)
        sign = "-" if value < 0 else ""
        if magnitude & (magnitude - 1) == 0:
            return f"{sign}2^{magnitude.bit_length() - 1}"
        if value > 0 and (value + 1) & value == 0:
            return f"2^{value.bit_length()} - 1"
        return f"{value:,}".replace(",", " ")
    return str(value)


def default_text(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    factory = field.default_factory
    value = factory() if factory is not None else field.default  # type: ignore[call-arg]
    if isinstance(value, BaseModel):
        dumped = value.model_dump(mode="json", exclude_defaults=True)
        return code(_inline(dumped)) if dumped else "see its table"
    if isinstance(value, dict) and value and all(isinstance(v, BaseModel) for v in value.values()):
        # e.g. the bundled sites: their paths are this machine's, so only the names are shown
        return f"{len(value)} tables: " + ", ".join(code(k) for k in value)
    if value is None:
        return "unset"
    text = code(_inline(_plain(value)))
    return f"{text} ({size(value)})" if size(value) != str(value) else text


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_defaults=True)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _inline(value: Any) -> str:
    """A value as TOML would spell it inline."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_inline(v)}" for k, v in value.items()) + " }" if value else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


@dataclass(frozen=True)
class Section:
    """One table of a config file: its TOML name and the model that validates it."""

    title: str
    model: type[BaseModel]
    prefix: str = ""  # how keys are written: "" at the top level, "train." inside [train]
    note: str = ""


def nested_model(field: FieldInfo) -> type[BaseModel] | None:
    """The model of a table field, also of an optional one (`train.dp`: unset or a table)."""
    bare, _ = _strip(field.annotation)
    if typing.get_origin(bare) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(bare) if a is not type(None)]
        bare = members[0] if len(members) == 1 else bare
    return bare if isinstance(bare, type) and issubclass(bare, BaseModel) else None


def fields_table(section: Section) -> str:
    rows = []
    for name, field in section.model.model_fields.items():
        sub = nested_model(field)
        kind = f"table `[{section.prefix}{name}]`" if sub is not None else type_name(field.annotation)
        rows.append((code(section.prefix + name), kind, default_text(field), valid_range(field),
                     field.description or "—"))
    return table(("Key", "Type", "Default", "Valid values", "Description"), rows)


def sections_for(model: type[BaseModel], role: str, prefix: str = "",
                 seen: tuple[type, ...] = ()) -> list[Section]:
    """The model's own table, then one section per nested model field (depth first)."""
    out = [Section(f"{role}: `[{prefix[:-1]}]`" if prefix else f"{role}: top-level keys", model, prefix,
                   (typing.cast(str, model.__doc__) or "").strip().split("\n")[0])]
    for name, field in model.model_fields.items():
        sub = nested_model(field)
        if sub is not None and sub not in seen:
            out += sections_for(sub, role, f"{prefix}{name}.", (*seen, model))
    return out


def render_sections(sections: list[Section]) -> str:
    parts = []
    for s in sections:
        note = f"{s.note}\n\n" if s.note else ""
        parts.append(f"#### {s.title}\n\n{note}{fields_table(s)}")
    return "\n".join(parts)


def data_options() -> str:
    """The `options` table of [data], per format (fedmqtt.data.spec.OPTIONS)."""
    parts = []
    for fmt, model in OPTIONS.items():
        doc = (model.__doc__ or "").strip().split("\n")[0]
        if model.model_fields:
            body = fields_table(Section("", model, "data.options."))
        else:
            body = "No options.\n"
        parts.append(f"#### Site: `format = \"{fmt}\"` options\n\n{doc}\n\n{body}")
    return "\n".join(parts)


# -- examples, validated while rendering ------------------------------------------------------------------
PS_EXAMPLE = """\
run_id = "cardio-2026"
algorithm = "fedprox"
rounds = 20
sites = ["cleveland", "hungary", "switzerland", "va"]
quorum = 3
round_timeout_s = 300
seed = 0
selection_metric = "auroc"
out_dir = "runs/cardio"
credentials = "fed/credentials/ps.toml"

[hyper]
mu = 0.01

[model]
name = "mlp"
args = { in_features = 15, hidden = [32, 32], dropout = 0.3 }

[train]
epochs = 2
batch_size = 32
lr = 0.001
optimizer = "adam"
"""

SITE_EXAMPLE = """\
site_id = "cleveland"
run_id = "cardio-2026"
credentials = "cleveland.toml"
state_dir = "state"
device = "auto"
amp = "auto"
threads = 4
share_label_histogram = false

[data]
format = "heart_disease"
path = "/data/processed.cleveland.data"
split_seed = 0
fractions = [0.6, 0.2, 0.2]
"""

CREDENTIALS_EXAMPLE = """\
[broker]
host = "broker.example.org"
port = 8883
username = "cleveland"
password = "(written by fedmqtt broker init)"
tls_ca_file = "ca.crt"
"""

SIMULATION_EXAMPLE = """\
run_id = "heart-fedavg"
algorithm = "fedavg"
rounds = 10
seed = 1
out_dir = "runs/heart-fedavg"

[train]
epochs = 2
batch_size = 32
lr = 0.001

[sites.cleveland]
format = "heart_disease"
path = "data/processed.cleveland.data"

[sites.hungary]
format = "heart_disease"
path = "data/processed.hungarian.data"
"""

EXAMPLES = (("PS config (`fedmqtt ps start --config ps.toml`)", "ps.toml", PS_EXAMPLE, DaemonConfig, None),
            ("Site config (`fedmqtt site start --config site.toml`)", "site.toml", SITE_EXAMPLE, SiteConfig,
             None),
            ("Credentials file (written by `fedmqtt broker init`; the `[broker]` table)", "cleveland.toml",
             CREDENTIALS_EXAMPLE, BrokerSettings, "broker"),
            ("Simulation config (`fedmqtt simulate sim.toml`)", "sim.toml", SIMULATION_EXAMPLE,
             SimulationConfig, None))


def check_examples() -> None:
    """Each example must be accepted by its model (else pydantic's ValidationError names the key)."""
    for _, _, text, model, section in EXAMPLES:
        data = tomllib.loads(text)
        model.model_validate(data[section] if section else data)


def examples() -> str:
    check_examples()
    return "\n".join(f"### {title}\n\n`{name}`:\n\n```toml\n{text}```\n"
                     for title, name, text, _, _ in EXAMPLES)


TEMPLATE = """\
# Configuration

<!-- Generated by fedmqtt/docgen/configuration.py from the config models: edit the models' `description=`
or that file, then run `python -m fedmqtt.docgen`. A test fails while this file is out of date. -->

Every file below is TOML, validated by a pydantic model when it is read: an unknown key, a wrong type or a
value out of range stops the program with a message naming the key. Relative paths are resolved against the
folder of the file that holds them. Each table lists a key's type, its default (**required** keys have none),
the values the model accepts, and what it does.

Roles and their files:

- the **PS** reads one config (`fedmqtt ps start --config ps.toml`), which names its credentials file;
- each **site** reads one config (`fedmqtt site start --config site.toml`), which names that site's own
  credentials file;
- every party's **credentials file** holds a `[broker]` table: how to reach the broker and as whom, and a
  `[signing]` table: the party's own signing key and the keys it checks others against (`fedmqtt broker init`
  writes one per party);
- a **simulation** (`fedmqtt simulate sim.toml`) describes a whole federation in one file and runs it in one process.

@@EXAMPLES@@
## PS config

Read by `fedmqtt ps start`. Keys that change results are fixed for a run: `--resume` refuses a config whose
hash differs from the checkpoint's, except for `credentials`, `out_dir`, `round_timeout_s`, `keep_checkpoints`
and `pretrained`. In every task the PS replaces `train.algorithm` by `algorithm` and `train.seed` by `seed`,
and merges `hyper` into `train.hyper`.

@@PS@@
## Site config

Read by `fedmqtt site start`. The hospital owns this file: what may leave the site (`share_label_histogram`)
is decided here, not by the PS.

@@SITE@@
### `[data.options]` by format

@@OPTIONS@@
## Broker settings

The `[broker]` table of every credentials file (PS, each site, the observer). The chunking and budget keys are
explained in docs/protocol.md, "Chunked transfer". The `[signing]` table beside it is written by `fedmqtt broker
init`, `add-site` and `rotate`, never by hand (docs/protocol.md, "Signatures").

@@BROKER@@
## Simulation config

Read by `fedmqtt simulate` (and `fedmqtt grid` for each cell). It holds the PS settings and every site's data;
`sites` maps a site id to a `[data]` table as in the site config, or to the path of a TOML file holding one.

@@SIMULATION@@"""


def render_configuration() -> str:
    simulation = sections_for(SimulationConfig, "Simulation")
    simulation = [s for s in simulation if s.model is not DataSpec]
    parts = {
        "EXAMPLES": "## Examples\n\n" + examples(),
        "PS": render_sections(sections_for(DaemonConfig, "PS")),
        "SITE": render_sections(sections_for(SiteConfig, "Site")),
        "OPTIONS": data_options(),
        "BROKER": render_sections([Section("Credentials: `[broker]`", BrokerSettings, "",
                                           (BrokerSettings.__doc__ or "").strip().split("\n")[0]),
                                   Section("Credentials: `[signing]`", SigningSettings, "",
                                           (SigningSettings.__doc__ or "").strip().split("\n")[0])]),
        "SIMULATION": render_sections(simulation),
    }
    text = TEMPLATE
    for name, value in parts.items():
        text = text.replace(f"@@{name}@@", value)
    return text


def render() -> dict[str, str]:
    return {PATH: render_configuration()}
