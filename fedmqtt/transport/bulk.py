"""Chunked transfer of large payloads: cut on the sender, fetched in windows and verified on the receiver.

Why this shape (design.md section 3):
- The sender publishes every chunk retained on `<topic>/chunk/<i>` *before* the manifest on `<topic>`, so a
  manifest always points at chunks the broker already holds, and a late or restarted receiver finds them.
- A receiver subscribes to a chunk's exact topic only when it wants it, a window at a time: the broker
  then never queues more than a window per client (past `max_queued_bytes` Mosquitto drops silently),
  and one receiver holds one reassembly buffer at a time, so the PS's memory does not grow with sites.
- A lost chunk is fetched again by subscribing to its topic once more (the broker replays the retained
  copy); a corrupted one (SHA-256 mismatch) likewise. A chunk from another transfer is stale and ignored.
  If re-fetching does not help, the transfer fails with a reason that names the chunks; it never yields
  a wrong payload.

This module holds the logic only; `Fetcher` talks to the broker through the three `BulkLink` calls.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fedmqtt.transport.topics import chunk_topic
from schemas.chunks import Chunk, ChunkManifest, TensorEntry, chunk_digest, root_digest

log = logging.getLogger(__name__)


class BulkLink(Protocol):
    def subscribe(self, filters: list[str]) -> None: ...
    def unsubscribe(self, filters: list[str]) -> None: ...
    def refetch(self, filters: list[str]) -> None: ...


def tensor_index(message: Any) -> tuple[TensorEntry, ...]:
    blobs = getattr(message, "tensors", ()) or ()
    return tuple(TensorEntry(name=b.name, dtype=b.dtype, shape=b.shape) for b in blobs)


def split(payload: bytes, message: Any, *, chunk_bytes: int) -> tuple[ChunkManifest, Callable[[], Iterator[Chunk]]]:
    """The manifest of `payload` (the encoded `message`) and a generator of its chunks, made lazily so the
    sender never holds a second copy of a large model."""
    view = memoryview(payload)
    count = math.ceil(len(payload) / chunk_bytes)
    digests = tuple(chunk_digest(view[i * chunk_bytes:(i + 1) * chunk_bytes]) for i in range(count))
    header = dict(run_id=message.run_id, sender=message.sender, round=message.round)
    manifest = ChunkManifest(**header, inner_kind=message.kind, transfer_id=message.msg_id,
                             total_bytes=len(payload), chunk_bytes=chunk_bytes, chunk_sha256=digests,
                             root_sha256=root_digest(digests), tensor_index=tensor_index(message))

    def chunks() -> Iterator[Chunk]:
        for i in range(count):
            yield Chunk(**header, msg_id=f"{message.msg_id[:48]}-c{i}", transfer_id=message.msg_id, index=i,
                        data=bytes(view[i * chunk_bytes:(i + 1) * chunk_bytes]))

    return manifest, chunks


@dataclass
class TransferStats:
    chunks: int = 0
    duplicates: int = 0
    stale: int = 0
    corrupt: int = 0
    refetches: int = 0
    completed: int = 0
    failed: int = 0


@dataclass
class Completed:
    topic: str
    manifest: ChunkManifest
    payload: bytearray


@dataclass
class Failed:
    topic: str
    manifest: ChunkManifest
    reason: str


@dataclass
class _Transfer:
    topic: str
    manifest: ChunkManifest
    buffer: bytearray
    have: bytearray  # 1 per chunk received and verified
    next_index: int = 0  # the next chunk not yet asked for
    outstanding: set[int] = field(default_factory=set)
    to_unsubscribe: list[int] = field(default_factory=list)
    corrupt_tries: dict[int, int] = field(default_factory=dict)
    stalls: int = 0
    last_progress: float = 0.0
    received: int = 0


class Fetcher:
    """Fetches one chunked transfer at a time; newer manifests for a topic replace older pending ones."""

    def __init__(self, link: BulkLink, *, window_bytes: int, stall_s: float, max_refetches: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.link = link
        self.window_bytes = window_bytes
        self.stall_s = stall_s
        self.max_refetches = max_refetches
        self.clock = clock
        self.stats = TransferStats()
        self.active: _Transfer | None = None
        self.pending: OrderedDict[str, ChunkManifest] = OrderedDict()

    # -- manifests --------------------------------------------------------------------------------
    def offer(self, topic: str, manifest: ChunkManifest) -> Failed | None:
        """Queue a transfer; returns a Failed if it replaces the active one (a newer model superseded it)."""
        active = self.active
        if active is not None and active.topic == topic:
            if active.manifest.transfer_id == manifest.transfer_id:
                return None  # a replay of what we are fetching
            self.pending[topic] = manifest
            return self._fail(f"superseded by transfer {manifest.transfer_id[:12]} (round {manifest.round})")
        self.pending[topic] = manifest
        self.pending.move_to_end(topic)
        if self.active is None:
            self._start_next()
        return None

    @property
    def busy(self) -> bool:
        return self.active is not None or bool(self.pending)

    def _start_next(self) -> None:
        if self.active is not None or not self.pending:
            return
        topic, manifest = self.pending.popitem(last=False)
        self.active = _Transfer(topic, manifest, bytearray(manifest.total_bytes), bytearray(manifest.count),
                                last_progress=self.clock())
        self._top_up(self.active)

    def _window(self, manifest: ChunkManifest) -> int:
        return max(1, self.window_bytes // manifest.chunk_bytes)

    def _top_up(self, t: _Transfer) -> None:
        """Ask for more chunks once half the window has arrived; drop subscriptions we are done with."""
        window = self._window(t.manifest)
        if t.to_unsubscribe and (len(t.outstanding) <= window // 2 or t.received == t.manifest.count):
            self.link.unsubscribe([chunk_topic(t.topic, i) for i in t.to_unsubscribe])
            t.to_unsubscribe.clear()
        if len(t.outstanding) > window // 2 or t.next_index >= t.manifest.count:
            return
        new = list(range(t.next_index, min(t.manifest.count, t.next_index + window - len(t.outstanding))))
        t.next_index += len(new)
        t.outstanding.update(new)
        self.link.subscribe([chunk_topic(t.topic, i) for i in new])

    # -- chunks -----------------------------------------------------------------------------------
    def on_chunk(self, topic: str, index: int, chunk: Chunk) -> Completed | Failed | None:
        """Take one chunk (already schema-checked, sender matched to topic) of `topic`."""
        t = self.active
        self.stats.chunks += 1
        if t is None or t.topic != topic or chunk.transfer_id != t.manifest.transfer_id:
            self.stats.stale += 1
            return None
        m = t.manifest
        if chunk.index != index or index >= m.count:
            return self._corrupt(t, index, f"chunk {chunk.index} arrived on the topic of chunk {index}")
        if t.have[index]:
            self.stats.duplicates += 1
            return None
        if len(chunk.data) != m.chunk_length(index) or chunk_digest(chunk.data) != m.chunk_sha256[index]:
            return self._corrupt(t, index, f"chunk {index} of {m.count} fails its SHA-256 or length check")
        start = index * m.chunk_bytes
        t.buffer[start:start + len(chunk.data)] = chunk.data
        t.have[index] = 1
        t.received += 1
        t.outstanding.discard(index)
        t.to_unsubscribe.append(index)
        t.last_progress = self.clock()
        t.stalls = 0
        self._top_up(t)
        if t.received < m.count:
            return None
        self.active = None
        self.stats.completed += 1
        self._start_next()
        return Completed(t.topic, m, t.buffer)

    def _corrupt(self, t: _Transfer, index: int, what: str) -> Failed | None:
        self.stats.corrupt += 1
        tries = t.corrupt_tries.get(index, 0) + 1
        t.corrupt_tries[index] = tries
        if tries > self.max_refetches:
            return self._fail(f"{what}, still after {self.max_refetches} re-fetches")
        log.warning("%s: %s; fetching it again", t.topic, what)
        self.stats.refetches += 1
        if index < t.manifest.count:
            self.link.refetch([chunk_topic(t.topic, index)])
        return None

    # -- time -------------------------------------------------------------------------------------
    def tick(self) -> Failed | None:
        """Re-fetch what has not arrived after `stall_s` without progress; fail after `max_refetches`."""
        t = self.active
        if t is None or self.clock() - t.last_progress < self.stall_s:
            return None
        missing = sorted(t.outstanding)
        if t.stalls >= self.max_refetches:
            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            return self._fail(f"chunks [{shown}] of {t.manifest.count} missing or stale after "
                              f"{self.max_refetches} re-fetches")
        t.stalls += 1
        t.last_progress = self.clock()
        self.stats.refetches += 1
        log.warning("%s: no chunk for %.0f s; fetching %d missing chunk(s) again", t.topic, self.stall_s, len(missing))
        self.link.refetch([chunk_topic(t.topic, i) for i in missing])
        return None

    def _fail(self, reason: str) -> Failed:
        t = self.active
        assert t is not None
        self.active = None
        subscribed = sorted(t.outstanding) + t.to_unsubscribe
        if subscribed:
            self.link.unsubscribe([chunk_topic(t.topic, i) for i in subscribed])
        self.stats.failed += 1
        self._start_next()
        return Failed(t.topic, t.manifest, reason)
