"""Large payloads as chunks: one small manifest on the message's own topic, the bytes under `<topic>/chunk/<i>`.

Any encoded message above the sender's threshold is cut into equal chunks (the last may be shorter). The
manifest names the transfer (the inner message's msg_id), the byte count, the chunk size, a SHA-256 per
chunk and a tensor index, so a receiver can size its buffer, spot a lost, duplicated, stale or corrupted
chunk by itself and refuse an oversized transfer before it allocates anything.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

from pydantic import Field, model_validator

from schemas.base import MAX_TENSORS, Frozen, Header
from schemas.tensors import DType, Shape, TensorBytes

MIN_CHUNK_BYTES = 1024
MAX_CHUNK_BYTES = 8 * 1024 * 1024  # keeps every MQTT packet under mosquitto.conf's max_packet_size
MAX_TRANSFER_BYTES = 2**40  # far above any max_payload_bytes; the receiver's own budget is the real cap
# Chunks per transfer. The broker's ACL lists every chunk topic a site may write (`<topic>/chunk/0` ...
# `<topic>/chunk/127`): Mosquitto's `+` would match any name at that level, so a site could store retained
# messages under as many made-up "chunk indices" as it liked. 128 chunks of at most MAX_CHUNK_BYTES carry 1 GiB
# (the default max_payload_bytes); a sender whose payload needs more chunks uses larger ones (transport/bulk.py).
MAX_CHUNKS = 128
MAX_CHUNKED_BYTES = MAX_CHUNKS * MAX_CHUNK_BYTES  # the most one chunked transfer can carry
_SHA256_HEX = r"^[0-9a-f]{64}$"
Sha256Hex = Annotated[str, Field(pattern=_SHA256_HEX)]


class TensorEntry(Frozen):
    """One tensor of the chunked message: lets a receiver check the model's layout before downloading it."""

    name: str = Field(min_length=1, max_length=256)
    dtype: DType
    shape: Shape


class ChunkManifest(Header):
    """On `<topic>` in place of a message too large for one MQTT packet; its chunks are already retained."""

    kind: Literal["chunk_manifest"] = "chunk_manifest"
    inner_kind: str = Field(max_length=64)
    transfer_id: str = Field(min_length=8, max_length=64, pattern=r"^[0-9A-Za-z._:-]+$")  # the inner msg_id
    # Declared, not trusted: receivers size nothing by it (buffers grow with verified chunks) and refuse a
    # transfer above their own max_payload_bytes before fetching anything.
    total_bytes: int = Field(ge=1, le=MAX_TRANSFER_BYTES)
    chunk_bytes: int = Field(ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES)
    chunk_sha256: tuple[Sha256Hex, ...] = Field(max_length=MAX_CHUNKS)
    root_sha256: Sha256Hex  # SHA-256 of the concatenated chunk digests
    tensor_index: tuple[TensorEntry, ...] = Field(default=(), max_length=MAX_TENSORS)

    @property
    def count(self) -> int:
        return len(self.chunk_sha256)

    def chunk_length(self, index: int) -> int:
        return min(self.chunk_bytes, self.total_bytes - index * self.chunk_bytes)

    @model_validator(mode="after")
    def _check(self) -> ChunkManifest:
        expected = -(-self.total_bytes // self.chunk_bytes)  # integer ceil: no float, no OverflowError
        if self.count != expected:
            raise ValueError(f"{self.count} chunk digests for {self.total_bytes} bytes in chunks of "
                             f"{self.chunk_bytes} (expected {expected})")
        if root_digest(self.chunk_sha256) != self.root_sha256:
            raise ValueError("root_sha256 does not match the chunk digests")
        return self


class Chunk(Header):
    """On `<topic>/chunk/<index>`: bytes [index * chunk_bytes, ...) of transfer `transfer_id`."""

    kind: Literal["chunk"] = "chunk"
    transfer_id: str = Field(min_length=8, max_length=64, pattern=r"^[0-9A-Za-z._:-]+$")
    index: int = Field(ge=0, lt=MAX_CHUNKS)
    # A received chunk holds bytes (checked against these bounds); one being sent holds a read-only view of the
    # encoded message (fedmqtt/transport/bulk.py), so cutting a model into chunks copies nothing.
    data: TensorBytes = Field(min_length=1, max_length=MAX_CHUNK_BYTES)


def chunk_digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def root_digest(chunk_digests: tuple[str, ...] | list[str]) -> str:
    """One hash for the whole payload without hashing its bytes twice."""
    return hashlib.sha256("".join(chunk_digests).encode()).hexdigest()
