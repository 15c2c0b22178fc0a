"""The only module that turns messages into bytes and back (msgpack; JSON for observer-facing kinds).

Why two encodings: status and metrics must be readable with `mosquitto_sub` and no project code,
so they are JSON text; everything that can carry tensors is msgpack with raw `bin` bytes.
A msgpack map never starts with `{`, so the first byte tells the two apart.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
from pydantic import TypeAdapter, ValidationError

from fedmqtt.errors import SchemaError
from schemas.base import SCHEMA_VERSION
from schemas.messages import TEXT_KINDS, Message

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)


def encode(message: Any, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Serialise a message; refuse to produce more than `max_bytes` (the broker would drop it)."""
    if message.kind in TEXT_KINDS:
        data = message.model_dump_json().encode("utf-8")
    else:
        data = msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)
    if len(data) > max_bytes:
        raise SchemaError(f"{message.kind} of {len(data)} bytes exceeds the budget of {max_bytes} bytes")
    return data


def decode(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Message:
    """Parse and validate a payload; raise SchemaError saying what is wrong."""
    if len(data) > max_bytes:
        raise SchemaError(f"payload of {len(data)} bytes exceeds the budget of {max_bytes} bytes")
    if not data:
        raise SchemaError("empty payload")
    try:
        if data[:1] == b"{":
            obj = json.loads(data.decode("utf-8"))
        else:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=max_bytes)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, UnicodeDecodeError) as exc:
        raise SchemaError(f"malformed payload: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise SchemaError(f"payload is a {type(obj).__name__}, expected a map")
    version = obj.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SchemaError(f"schema_version {version!r} is not supported (this build speaks {SCHEMA_VERSION})")
    try:
        return _ADAPTER.validate_python(obj)
    except ValidationError as exc:
        raise SchemaError(f"invalid {obj.get('kind', '?')}: {_first_errors(exc)}") from None


def _first_errors(exc: ValidationError, limit: int = 3) -> str:
    parts = []
    for err in exc.errors()[:limit]:
        where = ".".join(str(p) for p in err["loc"])
        parts.append(f"{where}: {err['msg']}" if where else err["msg"])
    more = exc.error_count() - limit
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def json_schemas() -> dict[str, Any]:
    """JSON Schema of every payload kind, for other languages."""
    return _ADAPTER.json_schema(mode="validation")


def encode_checkpoint(checkpoint: Any) -> bytes:
    return msgpack.packb(checkpoint.model_dump(mode="python"), use_bin_type=True)


def decode_checkpoint(data: bytes) -> Any:
    """Parse a checkpoint file's bytes; SchemaError if it is damaged or of another version."""
    from schemas.checkpoint import Checkpoint  # local: checkpoints are not wire messages

    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
        return Checkpoint.model_validate(obj)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise SchemaError(f"damaged checkpoint: {type(exc).__name__}: {str(exc)[:200]}") from None
