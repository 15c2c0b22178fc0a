"""docs/protocol.md's payload tables and docs/schemas/*.json: each wire model's JSON Schema, where it travels,
and why a receiver (the channel, then the PS) refuses a payload.
"""

from __future__ import annotations

import inspect
import json
import typing

from pydantic import BaseModel

from fedmqtt.docgen.protocol_topics import encoding, kinds_on, placeholder, topic_rows
from fedmqtt.docgen.tables import code, table
from fedmqtt.transport import channel, signing
from ps_daemon.refusals import REFUSAL_CATEGORIES
from schemas import codec, envelope
from schemas.checkpoint import Checkpoint
from schemas.messages import Message
from schemas.signed import SignedEnvelope

SCHEMA_DIR = "docs/schemas"


def message_models() -> list[type[BaseModel]]:
    """The models of the wire union `schemas.messages.Message`, in its order."""
    union = typing.get_args(Message)[0]
    return list(typing.get_args(union))


def schema_files() -> dict[str, str]:
    """docs/schemas/<Model>.json for every wire message, the checkpoint, and the union (Message.json)."""
    models: list[type[BaseModel]] = [*message_models(), Checkpoint, SignedEnvelope]
    out = {f"{SCHEMA_DIR}/{model.__name__}.json": _json(model.model_json_schema()) for model in models}
    out[f"{SCHEMA_DIR}/Message.json"] = _json(codec.json_schemas())
    return out


def _json(value: object) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def _kind(model: type[BaseModel]) -> str:
    return model.model_fields["kind"].default


def schemas_table() -> str:
    where: dict[str, list[str]] = {}
    for sample, _, _ in topic_rows():
        if sample.endswith("/bridge"):
            continue
        for kind in kinds_on(sample):
            where.setdefault(kind, []).append(placeholder(sample))
    rows = []
    for model in message_models():
        kind = _kind(model)
        doc = (inspect.getdoc(model) or "").split("\n")[0]
        rows.append((f"[`{model.__name__}`](schemas/{model.__name__}.json)", code(kind),
                     "<br>".join(code(t) for t in where.get(kind, [])), encoding(kind), doc))
    rows.append(("[`Checkpoint`](schemas/Checkpoint.json)", code(_kind(Checkpoint)),
                 "on disk, never on the wire", "msgpack",
                 "what the PS saves after every aggregation (`--resume` reads it)"))
    rows.append(("[`SignedEnvelope`](schemas/SignedEnvelope.json)", "(none)", "around every msgpack payload",
                 "msgpack", "a msgpack kind with its signature: the array [signer, key id (8 bytes), Ed25519 "
                 "signature, body], body being the message's own encoding (JSON kinds carry the same `signature` "
                 "as their last member instead)"))
    return table(("Model", "kind", "Topics", "Encoding", "What it is"), rows)



# Why a receiver refuses a payload: the counter keys of ChannelStats and of ps/status's `rejected`.
_CATEGORY_MEANING = {
    "TOO_LARGE": "payload above max_payload_bytes (or a JSON kind above its text limit)",
    "TOO_DEEP": "nesting deeper than the codec allows",
    "MALFORMED": "not valid msgpack/JSON, or the wrong one of the two for its kind",
    "WRONG_VERSION": "schema_version is not this one",
    "SCHEMA": "fails its pydantic model (types, patterns, unknown fields)",
    "NON_FINITE": "NaN or Inf in a number or tensor",
    "OUT_OF_RANGE": "a number outside its field's bounds",
    "TENSOR_LAYOUT": "tensor bytes do not match dtype x shape",
    "BAD_TOPIC": "not a topic of this protocol",
    "WRONG_RUN": "a topic of another run",
    "WRONG_TOPIC": "a kind that does not belong on that topic",
    "WRONG_SENDER": "header `sender` is not the topic's owner",
    "WRONG_ADDRESS": "a task whose site_id is not the one in its topic",
    "MANIFEST_REFUSED": "the receiver refused the chunked transfer before fetching it (e.g. an update it did "
                        "not ask for)",
    "OVER_BUDGET": "the sender already has too many or too large chunked transfers queued",
    "TRANSFER_FAILED": "chunks missing or corrupt after every re-fetch, or slower than the minimum rate",
    "MISMATCH": "the reassembled message differs from its manifest",
    "INTERNAL": "a bug on the receiving side (logged with a traceback); the sender is not blamed",
    "UNSIGNED": "no signature (every payload but a chunk must carry one)",
    "WRONG_SIGNER": "signed by a party other than the topic's owner",
    "UNKNOWN_KEY": "the signer is not in the key list (removed), or signed with a key the list no longer has "
                   "(rotated)",
    "BAD_SIGNATURE": "the signature does not match the topic and bytes (altered on the way, or forged)",
}
_CATEGORY_MODULES = (codec, channel, envelope, signing)  # where the category constants are defined


def categories_table() -> str:
    rows = []
    for name, meaning in _CATEGORY_MEANING.items():
        module = next(mod for mod in _CATEGORY_MODULES if hasattr(mod, name))
        rows.append((code(getattr(module, name)), meaning))
    return table(("Category", "Refused because"), rows)


def ps_categories_table() -> str:
    """The PS's own refusals (ps_daemon/refusals.py): what its reason says, and the key ps/status counts it
    under."""
    labels: dict[str, list[str]] = {}
    for text, label in REFUSAL_CATEGORIES:
        labels.setdefault(label, []).append(f'"{text}"')
    return table(("Category", "The PS's reason mentions"),
                 ((code(k), ", ".join(v)) for k, v in labels.items()))

