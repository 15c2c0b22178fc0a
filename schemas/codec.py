"""The only module that turns messages into bytes and back (msgpack; JSON for observer-facing kinds).

Why two encodings: status and metrics must be readable with `mosquitto_sub` and no project code,
so they are JSON text; everything that can carry tensors is msgpack with raw `bin` bytes.
A msgpack map never starts with `{`, so the first byte tells the two apart.
"""

from __future__ import annotations

import json
import secrets
import struct
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
        data = pack(message.model_dump(mode="python"))
    if len(data) > max_bytes:
        raise SchemaError(f"{message.kind} of {len(data)} bytes exceeds the budget of {max_bytes} bytes")
    return data


_LARGE_BIN = 1 << 16  # from here on msgpack writes bin 32: a 0xc6 byte and a 4-byte big-endian length


def pack(obj: Any) -> bytes:
    """`msgpack.packb(obj, use_bin_type=True)`, byte for byte, with each large `bytes` copied exactly once.

    Why: packb appends into a buffer that keeps growing and then copies it into the result, which runs
    a 512 MB model at under 0.5 GB/s. Here the structure is packed with a short placeholder for each
    large blob, and the result is assembled by one `join` of the pieces and the blobs themselves.
    """
    blobs: list[bytes] = []
    token = secrets.token_bytes(16)

    def swap(value: Any) -> Any:
        if isinstance(value, (bytes, bytearray)) and len(value) >= _LARGE_BIN:
            blobs.append(value)
            return token
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [swap(v) for v in value]
        return value

    skeleton = msgpack.packb(swap(obj), use_bin_type=True)
    if not blobs:
        return skeleton
    placeholder = b"\xc4\x10" + token
    pieces = skeleton.split(placeholder)
    if len(pieces) != len(blobs) + 1:  # the random token cannot occur by chance; fall back if it ever did
        return msgpack.packb(obj, use_bin_type=True)
    out: list[bytes] = [pieces[0]]
    for blob, piece in zip(blobs, pieces[1:]):
        out += [b"\xc6" + struct.pack(">I", len(blob)), blob, piece]
    return b"".join(out)


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
    return pack(checkpoint.model_dump(mode="python"))


def decode_checkpoint(data: bytes) -> Any:
    """Parse a checkpoint file's bytes; SchemaError if it is damaged or of another version."""
    from schemas.checkpoint import Checkpoint  # local: checkpoints are not wire messages

    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
        return Checkpoint.model_validate(obj)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise SchemaError(f"damaged checkpoint: {type(exc).__name__}: {str(exc)[:200]}") from None
