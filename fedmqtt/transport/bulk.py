"""Chunked transfer of large payloads: cut on the sender, fetched in windows and verified on the receiver.

Why this shape (docs/design-notes.md, "Large models"):
- The sender publishes every chunk retained on `<topic>/chunk/<i>` *before* the manifest on `<topic>`, so a
  manifest always points at chunks the broker already holds, and a late or restarted receiver finds them.
- A receiver subscribes to a chunk's exact topic only when it wants it, a window at a time: the broker
  then never queues more than a window per client (past `max_queued_bytes` Mosquitto drops silently),
  and one receiver holds one reassembly buffer at a time, so the PS's memory does not grow with sites.
- A lost chunk is fetched again by subscribing to its topic once more (the broker replays the retained
  copy); a corrupted one (SHA-256 mismatch) likewise. A chunk from another transfer is stale and ignored.
  If re-fetching does not help, the transfer fails with a reason that names the chunks; it never yields
  a wrong payload.
- Nothing is sized by what a manifest declares: a manifest is a few kB that anyone with a topic can write. The
  reassembly buffer grows only as verified chunks arrive, and each sender's queued transfers are bounded by
  configuration (`max_pending_chunk_bytes`, `max_pending_manifests`). A transfer that trickles in slower than
  `min_rate_bytes_per_s` is given up, so one sender cannot hold the single fetch slot for ever.

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
from schemas.chunks import (
    MAX_CHUNK_BYTES,
    MAX_CHUNKED_BYTES,
    MAX_CHUNKS,
    Chunk,
    ChunkManifest,
    TensorEntry,
    chunk_digest,
    root_digest,
)
from schemas.codec import TOO_LARGE, WireError

log = logging.getLogger(__name__)
MAX_WINDOW_CHUNKS = 256


class BulkLink(Protocol):
    def subscribe(self, filters: list[str]) -> None: ...
    def unsubscribe(self, filters: list[str]) -> None: ...
    def refetch(self, filters: list[str]) -> None: ...


def tensor_index(message: Any) -> tuple[TensorEntry, ...]:
    """The tensors a chunked message declares in its manifest: its `tensors`, or a masked input's one ring vector
    (secure aggregation), so the receiver can refuse a wrong layout before fetching a chunk."""
    blobs = tuple(getattr(message, "tensors", ()) or ())
    masked = getattr(message, "masked", None)
    if masked is not None and hasattr(masked, "dtype"):
        blobs = (*blobs, masked)
    return tuple(TensorEntry(name=b.name, dtype=b.dtype, shape=b.shape) for b in blobs)


def split(payload: bytes, message: Any, *, chunk_bytes: int) -> tuple[ChunkManifest, Callable[[], Iterator[Chunk]]]:
    """The manifest of `payload` (the encoded `message`) and a generator of its chunks, made lazily so the
    sender never holds a second copy of a large model.

    A payload that would need more than MAX_CHUNKS chunks of `chunk_bytes` goes in MAX_CHUNKS larger ones (at
    most MAX_CHUNK_BYTES each): the broker grants exactly MAX_CHUNKS chunk topics per topic."""
    if len(payload) > MAX_CHUNKED_BYTES:
        raise WireError(TOO_LARGE, f"a {message.kind} of {len(payload)} bytes exceeds what one chunked transfer "
                                   f"carries ({MAX_CHUNKS} chunks of at most {MAX_CHUNK_BYTES} bytes)")
    chunk_bytes = max(chunk_bytes, -(-len(payload) // MAX_CHUNKS))
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
                        data=view[i * chunk_bytes:(i + 1) * chunk_bytes])  # a view: encoding copies it once

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
    payload: bytes


@dataclass
class Failed:
    topic: str
    manifest: ChunkManifest
    reason: str


@dataclass
class _Transfer:
    topic: str
    manifest: ChunkManifest
    have: bytearray  # 1 per chunk received and verified
    # Verified chunks 0..k-1 in order, joined once when the last arrives: appending each to one bytearray
    # reallocated and copied the whole buffer at nearly every chunk.
    parts: list[bytes | memoryview] = field(default_factory=list)
    filled: int = 0  # their bytes
    early: dict[int, bytes | memoryview] = field(default_factory=dict)  # verified, arrived ahead of the buffer
    next_index: int = 0  # the next chunk not yet asked for
    outstanding: set[int] = field(default_factory=set)
    to_unsubscribe: list[int] = field(default_factory=list)
    corrupt_tries: dict[int, int] = field(default_factory=dict)
    stalls: int = 0
    last_progress: float = 0.0
    received: int = 0
    started: float = 0.0
    deadline: float = math.inf  # give up when not complete by then (see Fetcher.min_rate_bytes_per_s)

    @property
    def held_bytes(self) -> int:
        """Bytes of chunk data this transfer holds: never more than what arrived and verified."""
        return self.filled + sum(len(c) for c in self.early.values())

    def store(self, index: int, data: bytes | memoryview) -> None:
        """Keep a verified chunk: append it (and any early successors) to the buffer, or park it until its turn."""
        chunk_bytes = self.manifest.chunk_bytes
        if index * chunk_bytes != self.filled:
            self.early[index] = data
            return
        self._append(data)
        follow = index + 1
        while follow in self.early:
            self._append(self.early.pop(follow))
            follow += 1

    def _append(self, data: bytes | memoryview) -> None:
        self.parts.append(data)
        self.filled += len(data)

    def joined(self) -> bytes:
        """The whole payload, once every chunk is in; the parts are let go as it is made."""
        payload = b"".join(self.parts)
        self.parts.clear()
        return payload


class Fetcher:
    """Fetches one chunked transfer at a time; newer manifests for a topic replace older pending ones.

    Budgets, per sender (the manifest's sender, which the channel has matched to the topic's owner): at most
    `max_pending_manifests` transfers queued or in progress, declaring at most `max_pending_chunk_bytes` in all.
    """

    def __init__(self, link: BulkLink, *, window_bytes: int, stall_s: float, max_refetches: int,
                 clock: Callable[[], float] = time.monotonic, max_pending_chunk_bytes: int = 2 << 30,
                 max_pending_manifests: int = 64, min_rate_bytes_per_s: float = 32 * 1024) -> None:
        self.link = link
        self.window_bytes = window_bytes
        self.stall_s = stall_s
        self.max_refetches = max_refetches
        self.clock = clock
        self.max_pending_chunk_bytes = max_pending_chunk_bytes
        self.max_pending_manifests = max_pending_manifests
        self.min_rate_bytes_per_s = min_rate_bytes_per_s
        self.stats = TransferStats()
        self.active: _Transfer | None = None
        self.pending: OrderedDict[str, ChunkManifest] = OrderedDict()

    # -- manifests --------------------------------------------------------------------------------
    def refusal(self, topic: str, manifest: ChunkManifest) -> str | None:
        """Why `manifest` would exceed its sender's budget (None: it fits). A manifest replaces the one
        queued or in progress on the same topic, so that one does not count."""
        queued = [m for t, m in self.pending.items() if t != topic and m.sender == manifest.sender]
        active = self.active
        if active is not None and active.topic != topic and active.manifest.sender == manifest.sender:
            queued.append(active.manifest)
        if len(queued) + 1 > self.max_pending_manifests:
            return (f"{manifest.sender} already has {len(queued)} chunked transfers queued "
                    f"(at most {self.max_pending_manifests})")
        declared = sum(m.total_bytes for m in queued) + manifest.total_bytes
        if declared > self.max_pending_chunk_bytes:
            return (f"{manifest.sender}'s queued chunked transfers would declare {declared} bytes "
                    f"(at most {self.max_pending_chunk_bytes})")
        return None

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

    def holds(self, topic: str) -> bool:
        """A transfer for `topic` is queued or under way."""
        return topic in self.pending or (self.active is not None and self.active.topic == topic)

    @property
    def busy(self) -> bool:
        return self.active is not None or bool(self.pending)

    def _start_next(self) -> None:
        if self.active is not None or not self.pending:
            return
        topic, manifest = self.pending.popitem(last=False)
        now = self.clock()
        # `have` is one byte per digest the manifest really carried (it arrived, so it is bounded by the
        # payload cap); the data buffer starts empty and grows with verified chunks only.
        self.active = _Transfer(topic, manifest, bytearray(manifest.count), last_progress=now, started=now,
                                deadline=now + self._grace_s + manifest.total_bytes / self.min_rate_bytes_per_s)
        self._top_up(self.active)

    @property
    def _grace_s(self) -> float:
        """Time the stall-and-refetch logic may take on top of the minimum rate: it decides before the rate does."""
        return self.stall_s * (self.max_refetches + 2)

    @property
    def held_bytes(self) -> int:
        """Chunk bytes held in memory right now (the active transfer's; queued ones hold nothing)."""
        return self.active.held_bytes if self.active is not None else 0

    def _window(self, manifest: ChunkManifest) -> int:
        """Chunks asked for at once: `window_bytes` worth, but never more than MAX_WINDOW_CHUNKS topics, so a
        manifest of tiny chunks cannot make us send one huge SUBSCRIBE (the broker would drop the connection)."""
        return max(1, min(MAX_WINDOW_CHUNKS, self.window_bytes // manifest.chunk_bytes))

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
        if index >= m.count:  # not part of this transfer (a leftover of a longer one): no state kept for it
            self.stats.stale += 1
            return None
        if chunk.index != index:
            return self._corrupt(t, index, f"chunk {chunk.index} arrived on the topic of chunk {index}")
        if t.have[index]:
            self.stats.duplicates += 1
            return None
        if len(chunk.data) != m.chunk_length(index) or chunk_digest(chunk.data) != m.chunk_sha256[index]:
            return self._corrupt(t, index, f"chunk {index} of {m.count} fails its SHA-256 or length check")
        t.store(index, chunk.data)
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
        assert t.filled == m.total_bytes and not t.early  # every chunk verified, in order
        return Completed(t.topic, m, t.joined())

    def _corrupt(self, t: _Transfer, index: int, what: str) -> Failed | None:
        self.stats.corrupt += 1
        tries = t.corrupt_tries.get(index, 0) + 1
        t.corrupt_tries[index] = tries
        if tries > self.max_refetches:
            return self._fail(f"{what}, still after {self.max_refetches} re-fetches")
        log.warning("%s: %s; fetching it again", t.topic, what)
        self.stats.refetches += 1
        self.link.refetch([chunk_topic(t.topic, index)])
        return None

    # -- time -------------------------------------------------------------------------------------
    def tick(self) -> Failed | None:
        """Re-fetch what has not arrived after `stall_s` without progress; fail after `max_refetches`."""
        t = self.active
        if t is None:
            return None
        if self.clock() > t.deadline:
            return self._fail(f"only {t.received} of {t.manifest.count} chunks after "
                              f"{self.clock() - t.started:.0f} s, slower than {self.min_rate_bytes_per_s:.0f} B/s")
        if self.clock() - t.last_progress < self.stall_s:
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
