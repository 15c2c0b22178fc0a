"""The only module that turns messages into bytes and back (msgpack; JSON for observer-facing kinds).

Why two encodings: status and metrics must be readable with `mosquitto_sub` and no project code,
so they are JSON text; everything that can carry tensors is msgpack with raw `bin` bytes.
A msgpack map never starts with `{`, so the first byte tells the two apart.

Decoding is hostile by default: every payload may come from a party holding valid credentials and bad intent.
Before anything is allocated in proportion to what the payload *claims*, its size, nesting depth, container
lengths and string lengths are bounded; then the schema checks types, ranges and finiteness. Every failure is a
`WireError` (a SchemaError) whose `category` is a short, stable counter key and whose text is one readable,
bounded line.
"""

from __future__ import annotations

import json
import secrets
import struct
import typing
from typing import Any

import msgpack
import numpy as np
from pydantic import TypeAdapter, ValidationError

from fedmqtt.errors import SchemaError
from schemas.base import SCHEMA_VERSION
from schemas.messages import TEXT_KINDS, Message
from schemas.msgpack_views import unpack_with_views

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
# Far above what real messages need (a message is <= 5 levels deep; the largest list is a 1 GiB manifest's
# chunk digests; the largest map a label histogram), far below what hurts a receiver.
MAX_DEPTH = 32
MAX_ARRAY_LEN = 1_000_000
MAX_MAP_LEN = 131_072
MAX_STR_LEN = 1024 * 1024
# Lists + maps in one payload: an empty one costs ~60 bytes of RAM for 1 wire byte. A message of MAX_TENSORS
# tensors needs two per tensor (the tensor's map and its shape).
MAX_CONTAINERS = 262_144
# Status and metrics documents are small summaries; JSON has no container limits while parsing, so its size is.
MAX_TEXT_BYTES = 4 * 1024 * 1024
REASON_CHARS = 200  # attacker-controlled text in a reason is cut to this
# From this size on a payload's tensor bytes are not copied out of it (schemas/msgpack_views.py): its tensors
# are read-only views that keep it alive. Below it, msgpack's C decoder copies them; that is cheap there.
VIEWS_FROM_BYTES = 1 << 20


class WireError(SchemaError):
    """A refused payload. `category` is a short, stable key for counters; str() is the full, bounded reason."""

    def __init__(self, category: str, reason: str) -> None:
        super().__init__(clip(reason, 4 * REASON_CHARS))
        self.category = category


# Rejection categories: counter keys in ChannelStats and in the PS's status.
TOO_LARGE = "too large"
TOO_DEEP = "too deep"
MALFORMED = "malformed"
WRONG_VERSION = "wrong version"
SCHEMA = "schema"
NON_FINITE = "non-finite"
OUT_OF_RANGE = "out of range"
TENSOR_LAYOUT = "tensor layout"


def clip(text: object, limit: int = REASON_CHARS) -> str:
    """`text` as one printable line of at most `limit` characters: it goes into logs and counters."""
    s = str(text)
    cut = s[:limit]
    if not cut.isprintable():
        cut = "".join(c if c.isprintable() else "?" for c in cut)
    return cut + ("..." if len(s) > limit else "")
_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)
_KINDS = frozenset(cls.model_fields["kind"].default for cls in typing.get_args(typing.get_args(Message)[0]))


# An encoded message: its bytes, or pieces whose concatenation they are (`encode_pieces`).
Encoded = bytes | list[bytes | memoryview]


def encoded_size(payload: Encoded) -> int:
    return len(payload) if isinstance(payload, bytes) else sum(len(piece) for piece in payload)


def encode(message: Any, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Serialise a message; refuse to produce more than `max_bytes` (the broker would drop it)."""
    if message.kind in TEXT_KINDS:
        data = message.model_dump_json().encode("utf-8")
    else:
        data = pack(message.model_dump(mode="python"))
    if len(data) > max_bytes:
        raise SchemaError(f"{message.kind} of {len(data)} bytes exceeds the budget of {max_bytes} bytes")
    return data


def encode_pieces(message: Any, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[bytes | memoryview]:
    """`encode(message)` as pieces whose concatenation it is (see `pack_pieces`): a large message's tensors stay
    in their arrays, so a sender that cuts it into chunks (fedmqtt/transport/bulk.py) never encodes it whole."""
    if message.kind in TEXT_KINDS:
        return [encode(message, max_bytes=max_bytes)]
    pieces = pack_pieces(message.model_dump(mode="python"))
    size = sum(len(piece) for piece in pieces)
    if size > max_bytes:
        raise SchemaError(f"{message.kind} of {size} bytes exceeds the budget of {max_bytes} bytes")
    return pieces


_LARGE_BIN = 1 << 16  # from here on msgpack writes bin 32: a 0xc6 byte and a 4-byte big-endian length


def pack(obj: Any) -> bytes:
    """`msgpack.packb(obj, use_bin_type=True)`, byte for byte, with each large blob copied exactly once."""
    pieces = pack_pieces(obj)
    if len(pieces) == 1 and isinstance(pieces[0], bytes):  # no large blob: the one piece is the encoding
        return pieces[0]
    return b"".join(pieces)


def pack_pieces(obj: Any) -> list[bytes | memoryview]:
    """The bytes of `pack(obj)` as pieces whose concatenation is that encoding; large blobs (bytes or
    read-only views of arrays) appear as themselves, uncopied.

    Why: packb appends into a buffer that keeps growing and then copies it into the result, which runs
    a 512 MB model at under 0.5 GB/s. Here the structure is packed with a short placeholder for each
    large blob; a file writer takes the pieces one after another (a checkpoint never exists twice in
    memory), and `pack` joins them with one copy.
    """
    blobs: list[bytes | memoryview] = []
    token = secrets.token_bytes(16)
    skeleton = msgpack.packb(_swap_blobs(obj, blobs, token), use_bin_type=True)
    if not blobs:
        return [skeleton]
    placeholder = b"\xc4\x10" + token
    pieces = skeleton.split(placeholder)
    if len(pieces) != len(blobs) + 1:  # the random token cannot occur by chance; fall back if it ever did
        return [msgpack.packb(obj, use_bin_type=True)]
    out: list[bytes | memoryview] = [pieces[0]]
    for blob, piece in zip(blobs, pieces[1:], strict=True):
        out += [b"\xc6" + struct.pack(">I", len(blob)), blob, piece]
    return out


def _swap_blobs(value: Any, blobs: list[bytes | memoryview], token: bytes) -> Any:
    """`value` with each large blob replaced by `token` and appended to `blobs`, in packing order. A function of
    its own, not a closure: a nested function that calls itself is a reference cycle, and it kept every blob
    (the views of a whole model's arrays) alive until the cycle collector happened to run."""
    if isinstance(value, (bytes, memoryview)) and len(value) >= _LARGE_BIN:
        blobs.append(value)
        return token
    if isinstance(value, dict):
        return {k: _swap_blobs(v, blobs, token) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_swap_blobs(v, blobs, token) for v in value]
    return value  # a (rare) bytearray stays inline: msgpack encodes it as the same bin


def decode(data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Message:
    """Parse and validate a payload; raise WireError (a SchemaError) saying what is wrong."""
    if len(data) > max_bytes:
        raise WireError(TOO_LARGE, f"payload of {len(data)} bytes exceeds the budget of {max_bytes} bytes")
    if not data:
        raise WireError(MALFORMED, "empty payload")
    text = data[:1] == b"{"
    obj = _parse_json(data) if text else _parse_msgpack(data, max_bytes)
    if not isinstance(obj, dict):
        raise WireError(MALFORMED, f"payload is a {type(obj).__name__}, expected a map")
    _check_nesting(obj)
    version = obj.get("schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        raise WireError(WRONG_VERSION, f"schema_version {clip(repr(version), 40)} is not supported "
                                       f"(this build speaks {SCHEMA_VERSION})")
    kind = obj.get("kind")
    if isinstance(kind, str) and kind in _KINDS and (kind in TEXT_KINDS) != text:
        # encode() writes observer kinds as JSON and the rest as msgpack; anything else is hand-made, and JSON
        # would let bytes fields arrive as text.
        raise WireError(MALFORMED, f"a {kind} must travel as {'JSON' if kind in TEXT_KINDS else 'msgpack'}")
    try:
        return _ADAPTER.validate_python(obj)
    except ValidationError as exc:
        raise WireError(_category(exc), f"invalid {clip(kind, 40)}: {_first_errors(exc)}") from None
    except (ValueError, TypeError, ArithmeticError, RecursionError, MemoryError) as exc:
        # Not expected (validators raise ValidationError), but a payload must never crash a receiver.
        raise WireError(SCHEMA, f"invalid {clip(kind, 40)}: {type(exc).__name__}: {clip(exc)}") from None


def _parse_msgpack(data: bytes | bytearray | memoryview, max_bytes: int) -> Any:
    """msgpack with every length bounded before it is allocated, and a cap on the number of containers. A large
    payload's tensor bytes stay in it, as views (see VIEWS_FROM_BYTES)."""
    if len(data) >= VIEWS_FROM_BYTES:
        obj = unpack_with_views(data, max_bin_len=max_bytes, max_str_len=MAX_STR_LEN, max_array_len=MAX_ARRAY_LEN,
                                max_map_len=MAX_MAP_LEN, max_containers=MAX_CONTAINERS, max_depth=MAX_DEPTH + 1)
        if obj is not None:
            return obj
    containers = 0

    def count(container: Any) -> Any:
        nonlocal containers
        containers += 1
        if containers > MAX_CONTAINERS:
            raise WireError(TOO_LARGE, f"more than {MAX_CONTAINERS} lists and maps")
        return container

    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=MAX_STR_LEN,
                               max_array_len=MAX_ARRAY_LEN, max_map_len=MAX_MAP_LEN, max_ext_len=0,
                               list_hook=count, object_hook=count)
    except msgpack.StackError:
        raise WireError(TOO_DEEP, "malformed payload: nested too deeply") from None
    except (ValueError, TypeError, msgpack.UnpackException, UnicodeDecodeError, RecursionError, MemoryError,
            OverflowError) as exc:
        reason = str(exc)
        category = TOO_LARGE if "exceeds max_" in reason else MALFORMED
        raise WireError(category, f"malformed payload: {type(exc).__name__}: {clip(reason)}") from None


_DEPTH_BLOCK = 1 << 18  # bytes scanned at a time: json_depth's temporaries stay ~2 MB for any payload


def json_depth(data: bytes | bytearray | memoryview) -> int:
    """Deepest bracket nesting outside strings, in linear time, without recursion and in bounded memory (run
    before json.loads, whose recursive parser would otherwise meet a hostile 100 000-deep document).

    Vectorised over blocks: a quote ends or starts a string unless an odd run of backslashes precedes it
    (escapes only occur inside strings; outside them a backslash is invalid JSON, which json.loads refuses).
    The backslash run, the in-string state and the depth carry from one block to the next. Stops early once
    the depth exceeds MAX_DEPTH.
    """
    codes = np.frombuffer(data, dtype=np.uint8)
    depth = deepest = 0
    in_string = 0  # 1 inside a string at the block's start
    backslashes = 0  # consecutive backslashes just before the block's start
    for start in range(0, codes.size, _DEPTH_BLOCK):
        c = codes[start:start + _DEPTH_BLOCK]
        idx = np.arange(c.size, dtype=np.int32)
        is_backslash = c == 0x5C
        last_other = np.maximum.accumulate(np.where(is_backslash, np.int32(-1), idx))
        run = idx - last_other + np.where(last_other < 0, np.int32(backslashes), np.int32(0))  # ending at i
        before = np.empty_like(run)
        before[0] = backslashes
        before[1:] = run[:-1]
        quote = (c == 0x22) & (before % 2 == 0)
        inside = ((np.cumsum(quote, dtype=np.int32) + in_string) & 1).astype(bool)
        opens = ((c == 0x5B) | (c == 0x7B)) & ~inside
        closes = ((c == 0x5D) | (c == 0x7D)) & ~inside
        levels = depth + np.cumsum(opens.astype(np.int8) - closes.astype(np.int8), dtype=np.int32)
        deepest = max(deepest, int(levels.max()))
        if deepest > MAX_DEPTH:
            return deepest
        # carry: the depth, whether the block ended inside a string, and its trailing run of backslashes
        depth, in_string, backslashes = int(levels[-1]), int(inside[-1]), int(run[-1])
    return deepest


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise WireError(NON_FINITE, f"number {clip(text, 40)} is not finite")
    return value


def _no_constant(name: str) -> None:
    raise WireError(NON_FINITE, f"{name} is not a JSON number")


def _parse_json(data: bytes | bytearray | memoryview) -> Any:
    if len(data) > MAX_TEXT_BYTES:
        raise WireError(TOO_LARGE, f"JSON payload of {len(data)} bytes exceeds {MAX_TEXT_BYTES} bytes")
    depth = json_depth(data)
    if depth > MAX_DEPTH:
        raise WireError(TOO_DEEP, f"JSON nested {depth} levels deep (at most {MAX_DEPTH})")
    try:
        return json.loads(bytes(data).decode("utf-8"), parse_float=_finite_float, parse_constant=_no_constant)
    except (ValueError, RecursionError, MemoryError, OverflowError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise WireError(MALFORMED, f"malformed payload: {type(exc).__name__}: {clip(exc)}") from None


_CONTAINER_TYPES = frozenset({dict, list})  # all that msgpack and json produce as containers


def _check_nesting(obj: Any) -> None:
    """Depth and container count of a parsed document, without recursion."""
    stack = [(obj, 1)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if depth > MAX_DEPTH:
            raise WireError(TOO_DEEP, f"payload nested more than {MAX_DEPTH} levels deep")
        if seen > MAX_CONTAINERS:
            raise WireError(TOO_LARGE, f"more than {MAX_CONTAINERS} lists and maps")
        children = node.values() if isinstance(node, dict) else node
        if _CONTAINER_TYPES.isdisjoint(map(type, children)):
            continue  # only leaves below (the common case, e.g. a million digests): scanned at C speed
        stack.extend((child, depth + 1) for child in children if type(child) in _CONTAINER_TYPES)


_CATEGORY_BY_ERROR = {
    "finite_number": NON_FINITE, "non_finite": NON_FINITE, "tensor_size": TENSOR_LAYOUT,
    "greater_than": OUT_OF_RANGE, "greater_than_equal": OUT_OF_RANGE, "less_than": OUT_OF_RANGE,
    "less_than_equal": OUT_OF_RANGE, "too_long": TOO_LARGE, "too_short": OUT_OF_RANGE,
    "string_too_long": TOO_LARGE, "string_too_short": OUT_OF_RANGE, "bytes_too_long": TOO_LARGE,
}


def _category(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False, include_input=False)
    return _CATEGORY_BY_ERROR.get(errors[0]["type"], SCHEMA) if errors else SCHEMA


def _first_errors(exc: ValidationError, limit: int = 3) -> str:
    parts = []
    for err in exc.errors(include_url=False, include_input=False)[:limit]:
        where = ".".join(clip(p, 40) for p in err["loc"])
        msg = clip(err["msg"])
        parts.append(f"{where}: {msg}" if where else msg)
    more = exc.error_count() - limit
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def json_schemas() -> dict[str, Any]:
    """JSON Schema of every payload kind, for other languages."""
    return _ADAPTER.json_schema(mode="validation")


def encode_checkpoint(checkpoint: Any) -> list[bytes | memoryview]:
    """A checkpoint's bytes as pieces to write one after another (see `pack_pieces`)."""
    return pack_pieces(checkpoint.model_dump(mode="python"))


def decode_checkpoint(data: bytes) -> Any:
    """Parse a checkpoint file's bytes; SchemaError if it is damaged or of another version."""
    from schemas.checkpoint import Checkpoint  # local: checkpoints are not wire messages

    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False, max_ext_len=0)
        return Checkpoint.model_validate(obj)
    except (ValueError, TypeError, msgpack.UnpackException, ArithmeticError, RecursionError, MemoryError) as exc:
        raise SchemaError(f"damaged checkpoint: {type(exc).__name__}: {clip(exc)}") from None
