"""msgpack decoding whose tensor bytes stay where they arrived: `data` fields become read-only views of the payload.

Why: msgpack has no zero-copy `bin`; `unpackb` copies every tensor out of the payload, so a received 1 GB model
existed twice (its reassembled bytes and their decoded copy) until the payload was dropped. Here the large `bin`
values under a `data` key (`TensorBlob.data`, `Chunk.data`: the only fields typed to take a view) are slices of
the payload, which they keep alive; every other value is what `unpackb(raw=False, strict_map_key=True)` gives.

Only the plain case is handled here, and in bounded work: anything this reader does not take as it is (an
ext type, a limit exceeded, invalid UTF-8, trailing bytes, a truncated payload, more than `max_items` values)
returns None, and the caller decodes with `unpackb`, whose bounds and error messages then apply unchanged.
The Python loop costs about a microsecond per value; `max_items` keeps a payload of many small values (hostile
or not) on the C path.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

VIEW_KEY = "data"
_FLOAT32, _FLOAT64 = struct.Struct(">f"), struct.Struct(">d")
_FIXED_INT = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False),
              0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)}


class _GiveUp(Exception):
    """Not a payload this reader takes as it is: the caller uses unpackb."""


class _Reader:
    def __init__(self, view: memoryview, *, limits: dict[str, int], max_items: int, min_view: int) -> None:
        self.view = view
        self.pos = 0
        self.items = 0
        self.containers = 0
        self.limits = limits
        self.max_items = max_items
        self.min_view = min_view

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.view):
            raise _GiveUp
        out = self.view[self.pos:end]
        self.pos = end
        return out

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "big")

    def value(self, depth: int, *, key: object = None) -> Any:
        self.items += 1
        if self.items > self.max_items or depth > self.limits["depth"]:
            raise _GiveUp
        b = self.uint(1)
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0xA0 <= b <= 0xBF:
            return self.text(b & 0x1F)
        if 0x90 <= b <= 0x9F:
            return self.array(b & 0x0F, depth)
        if 0x80 <= b <= 0x8F:
            return self.map(b & 0x0F, depth)
        if b == 0xC0:
            return None
        if b in (0xC2, 0xC3):
            return b == 0xC3
        if b in (0xC4, 0xC5, 0xC6):
            return self.binary(self.uint(1 << (b - 0xC4)), key)
        if b in (0xD9, 0xDA, 0xDB):
            return self.text(self.uint(1 << (b - 0xD9)))
        if b in (0xDC, 0xDD):
            return self.array(self.uint(2 if b == 0xDC else 4), depth)
        if b in (0xDE, 0xDF):
            return self.map(self.uint(2 if b == 0xDE else 4), depth)
        if b == 0xCA:
            return _FLOAT32.unpack(self.take(4))[0]
        if b == 0xCB:
            return _FLOAT64.unpack(self.take(8))[0]
        if b in _FIXED_INT:
            size, signed = _FIXED_INT[b]
            return int.from_bytes(self.take(size), "big", signed=signed)
        raise _GiveUp  # ext types (never ours: max_ext_len=0) and the unused 0xc1

    def text(self, n: int) -> str:
        if n > self.limits["str"]:
            raise _GiveUp
        try:
            return str(self.take(n), "utf-8")
        except UnicodeDecodeError:
            raise _GiveUp from None

    def binary(self, n: int, key: object) -> bytes | memoryview:
        if n > self.limits["bin"]:
            raise _GiveUp
        data = self.take(n)
        return data if key == VIEW_KEY and n >= self.min_view else bytes(data)

    def array(self, n: int, depth: int) -> list[Any]:
        self.container(n, self.limits["array"])
        return [self.value(depth + 1) for _ in range(n)]

    def map(self, n: int, depth: int) -> dict[Any, Any]:
        self.container(n, self.limits["map"])
        out: dict[Any, Any] = {}
        for _ in range(n):
            key = self.value(depth + 1)
            if not isinstance(key, (str, bytes)):  # unpackb's strict_map_key
                raise _GiveUp
            out[key] = self.value(depth + 1, key=key)
        return out

    def container(self, n: int, limit: int) -> None:
        self.containers += 1
        if n > limit or self.containers > self.limits["containers"] or n > self.max_items - self.items:
            raise _GiveUp


def unpack_with_views(data: bytes | bytearray | memoryview | mmap.mmap, *, max_bin_len: int, max_str_len: int,
                      max_array_len: int, max_map_len: int, max_containers: int, max_depth: int,
                      max_items: int = 100_000, min_view: int = 1 << 16) -> Any | None:
    """The object `data` encodes, with each `data` bin of `min_view` bytes or more a read-only view of `data`;
    None where this reader gives up (see the module's docstring)."""
    view = memoryview(data).cast("B").toreadonly() if not isinstance(data, bytes) else memoryview(data)
    limits = {"bin": max_bin_len, "str": max_str_len, "array": max_array_len, "map": max_map_len,
              "containers": max_containers, "depth": max_depth}
    reader = _Reader(view, limits=limits, max_items=max_items, min_view=min_view)
    try:
        obj = reader.value(1)
    except _GiveUp:
        return None
    return obj if reader.pos == len(view) else None


__all__ = ["VIEW_KEY", "unpack_with_views"]
