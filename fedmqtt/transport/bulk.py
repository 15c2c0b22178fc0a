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

import bisect
import hashlib
import itertools
import logging
import math
import mmap
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
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


class Spliced:
    """Pieces (an encoded message as `schemas.codec.encode_pieces` gives it) read as one byte string, unjoined."""

    def __init__(self, pieces: Sequence[bytes | memoryview]) -> None:
        self.pieces = [memoryview(p).cast("B") for p in pieces if len(p)]
        self.starts = list(itertools.accumulate((len(p) for p in self.pieces), initial=0))

    def __len__(self) -> int:
        return self.starts[-1]

    def parts(self, start: int, stop: int) -> list[memoryview]:
        """Views of bytes [start, stop), one per piece they span."""
        stop = min(stop, len(self))
        out = []
        i = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            offset = start - self.starts[i]
            end = min(stop, self.starts[i + 1])
            out.append(self.pieces[i][offset:offset + end - start])
            start, i = end, i + 1
        return out

    def slice(self, start: int, stop: int) -> bytes | memoryview:
        """Bytes [start, stop): a view where they lie in one piece, else the few pieces' parts joined."""
        parts = self.parts(start, stop)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def digest(self, start: int, stop: int) -> str:
        digest = hashlib.sha256()
        for part in self.parts(start, stop):
            digest.update(part)
        return digest.hexdigest()


def split(payload: bytes | Sequence[bytes | memoryview], message: Any, *,
          chunk_bytes: int) -> tuple[ChunkManifest, Callable[[], Iterator[Chunk]]]:
    """The manifest of `payload` (the encoded `message`, whole or as pieces) and a generator of its chunks, made
    lazily so the sender never holds a second copy of a large model: a chunk is a view of the piece it lies in
    (a tensor's own memory, for a message encoded as pieces); only one that spans pieces is joined.

    A payload that would need more than MAX_CHUNKS chunks of `chunk_bytes` goes in MAX_CHUNKS larger ones (at
    most MAX_CHUNK_BYTES each): the broker grants exactly MAX_CHUNKS chunk topics per topic."""
    pieces = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload
    size = sum(len(piece) for piece in pieces)
    if size > MAX_CHUNKED_BYTES:
        raise WireError(TOO_LARGE, f"a {message.kind} of {size} bytes exceeds what one chunked transfer "
                                   f"carries ({MAX_CHUNKS} chunks of at most {MAX_CHUNK_BYTES} bytes)")
    data = Spliced(pieces)
    chunk_bytes = max(chunk_bytes, -(-size // MAX_CHUNKS))
    count = math.ceil(size / chunk_bytes)
    digests = tuple(data.digest(i * chunk_bytes, (i + 1) * chunk_bytes) for i in range(count))
    header = dict(run_id=message.run_id, sender=message.sender, round=message.round)
    manifest = ChunkManifest(**header, inner_kind=message.kind, transfer_id=message.msg_id,
                             total_bytes=size, chunk_bytes=chunk_bytes, chunk_sha256=digests,
                             root_sha256=root_digest(digests), tensor_index=tensor_index(message))

    def chunks() -> Iterator[Chunk]:
        for i in range(count):
            yield Chunk(**header, msg_id=f"{message.msg_id[:48]}-c{i}", transfer_id=message.msg_id, index=i,
                        data=data.slice(i * chunk_bytes, (i + 1) * chunk_bytes))  # encoding copies it once

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
    payload: memoryview  # read-only, over the transfer's own map


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
    # The payload, written in place as verified chunks arrive. An anonymous map: its pages cost memory only once
    # a chunk is written into them, so what is resident never exceeds what arrived and verified (the manifest's
    # size only reserves addresses), and the whole payload is never joined or copied: the decoded message's
    # tensors are views of it (schemas/msgpack_views.py).
    buffer: mmap.mmap | None = None
    filled: int = 0  # bytes of verified chunks written
    next_index: int = 0  # the next chunk not yet asked for
    outstanding: set[int] = field(default_factory=set)
    to_unsubscribe: list[int] = field(default_factory=list)
    corrupt_tries: dict[int, int] = field(default_factory=dict)
    stalls: int = 0
    # A map made ready for this receiver's next payload (`Fetcher.prepare_next`), used if the size fits
    prepared: mmap.mmap | None = None
    last_progress: float = 0.0
    received: int = 0
    started: float = 0.0
    deadline: float = math.inf  # give up when not complete by then (see Fetcher.min_rate_bytes_per_s)

    @property
    def held_bytes(self) -> int:
        """Bytes of chunk data this transfer holds: never more than what arrived and verified."""
        return self.filled

    def store(self, index: int, data: bytes | memoryview) -> None:
        """Write a verified chunk (of its manifest's length) at its place in the payload."""
        if self.buffer is None:
            self.buffer = REASSEMBLY_MAPS.take(self.manifest.total_bytes, prepared=self.prepared)
            self.prepared = None
        start = index * self.manifest.chunk_bytes
        self.buffer[start:start + len(data)] = data
        self.filled += len(data)

    def payload(self) -> memoryview:
        """The whole payload, read-only, once every chunk is in (the map lives as long as views of it do). Every
        byte of it was written by a verified chunk: a reused map's earlier contents are all overwritten."""
        assert self.buffer is not None
        with memoryview(self.buffer) as whole:
            view = whole[:self.manifest.total_bytes].toreadonly()
        self.buffer = None
        return view


def reassembly_buffer(size: int) -> mmap.mmap:
    """An anonymous map of `size` bytes that costs memory only where chunks are written into it.

    Private, not mmap's default MAP_SHARED: a shared anonymous map is backed by shmem, whose page faults cost
    about three times as much (a 16 MB model took 15 ms of the site's CPU to write into one, 3 ms into this).
    Huge pages where the kernel offers them on request (transparent_hugepage "madvise" or "always"): a chunk
    fills 2 MB pages with one fault each instead of 512. Either way nothing is committed before a verified
    chunk is written, now in steps of at most one huge page."""
    flags = getattr(mmap, "MAP_PRIVATE", None)
    anonymous = getattr(mmap, "MAP_ANONYMOUS", None)
    if flags is None or anonymous is None:  # Windows: no flags, an anonymous map is already private
        return mmap.mmap(-1, size)
    buffer = mmap.mmap(-1, size, flags=flags | anonymous)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buffer.madvise(advice)
        except OSError:  # a kernel built without transparent huge pages: ordinary pages
            pass
    return buffer


class ReassemblyMaps:
    """Reassembly maps kept to be written over by a later transfer once nothing reads them any more.

    A fresh map costs a page fault per huge page (or per 4 kB page) and the kernel's zeroing of it: 3.6 ms of CPU
    for 16 MB here against 1.0 ms to write the same chunks over a map whose pages are already there. A site
    receives a model of the same size every round, and the PS updates of nearly the same size, so the map of a
    payload nobody holds any more (the model before last, an update already spooled) takes the next one.

    A map is reused only when no transfer and no view of it is left: `sys.getrefcount` then counts this pool's
    reference alone (every memoryview, numpy array or decoded tensor of the payload holds one on the map). Sizes
    are rounded up to 2 MiB (addresses only; nothing is committed before a chunk is written), so payloads a few
    bytes apart share a map. Only payloads of `min_bytes` to `max_bytes` are pooled (below, faults cost little;
    above, a spare model-sized map would weigh on memory), and the pool, one per process (a simulation's agents
    and PS share it), keeps maps of at most `keep_bytes` in all. A deployed site ends up with two maps (the model
    it holds and the next one), so between rounds it keeps one model-sized map more than before."""

    ROUND = 2 << 20

    def __init__(self, *, min_bytes: int = 4 << 20, max_bytes: int = 64 << 20, keep_bytes: int = 128 << 20) -> None:
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self.keep_bytes = keep_bytes
        self.reused = 0  # maps taken again (for tests and benches)
        self._maps: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, size: int, *, prepared: mmap.mmap | None = None) -> mmap.mmap:
        """A map of at least `size` bytes, reused if one is free; its contents are whatever it held before.
        `prepared` (from `prepare`, held by the caller alone) is taken first when its size fits."""
        capacity = -(-size // self.ROUND) * self.ROUND
        if not self.min_bytes <= size <= self.max_bytes or _ONLY_IN_A_LIST < 0:
            return reassembly_buffer(size)
        if prepared is not None and len(prepared) == capacity:
            self.reused += 1
            return prepared
        with self._lock:
            free = [i for i in range(len(self._maps)) if self._unused(i)]
            for i in free:
                if len(self._maps[i]) == capacity:
                    self.reused += 1
                    return self._maps[i]
            for i in reversed(free):  # free maps of other sizes make room (unmapped with their last reference)
                if sum(map(len, self._maps)) + capacity <= self.keep_bytes:
                    break
                del self._maps[i]
            buffer = reassembly_buffer(capacity)
            if sum(map(len, self._maps)) + capacity <= self.keep_bytes:
                self._maps.append(buffer)
            return buffer

    def prepare(self, size: int) -> mmap.mmap | None:
        """A map for a later payload of `size` bytes with its pages already in, kept by the caller (so no other
        transfer of the process takes it) and pooled like any other once it has served; None for sizes the pool
        does not keep. For a receiver that still holds this payload when the next one of its size arrives (a site
        holds round r's model while round r+1's comes in): its second transfer would otherwise fault in a fresh map
        (8-9 ms of CPU at 16 MB on the test machine, whose new pages are dear; see docs/benchmarks.md). Its pages
        are paid for where this is called, once per process, as the pool pays for every map it keeps."""
        capacity = -(-size // self.ROUND) * self.ROUND
        if not self.min_bytes <= size <= self.max_bytes or _ONLY_IN_A_LIST < 0:
            return None
        buffer = reassembly_buffer(capacity)
        zeros = bytes(1 << 20)
        for start in range(0, capacity, len(zeros)):  # fault the pages in now
            buffer[start:start + len(zeros)] = zeros
        with self._lock:
            if sum(map(len, self._maps)) + capacity <= self.keep_bytes:
                self._maps.append(buffer)
        return buffer

    def _unused(self, i: int) -> bool:
        return sys.getrefcount(self._maps[i]) == _ONLY_IN_A_LIST  # no transfer, no view: this list's reference alone

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()


def _refcount_in_a_list() -> int:
    """What `sys.getrefcount` says of an object that only a list holds, read as `ReassemblyMaps._unused` reads it
    (measured, not assumed: interpreters differ in whether the call's argument counts)."""
    held: list[object] = [object()]
    return sys.getrefcount(held[0]) if hasattr(sys, "getrefcount") else -1


_ONLY_IN_A_LIST = _refcount_in_a_list()
REASSEMBLY_MAPS = ReassemblyMaps()


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
        # Set by a receiver that holds a payload while the next of its size arrives (a site and its models): its
        # first completed transfer makes the map of its second ready (`ReassemblyMaps.prepare`), once.
        self.prepare_next = False
        self._prepared: mmap.mmap | None = None
        self._prepared_once = False

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
                                deadline=now + self._grace_s + manifest.total_bytes / self.min_rate_bytes_per_s,
                                prepared=self._prepared)
        self._prepared = None
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
        if self.prepare_next and not self._prepared_once:
            self._prepared = REASSEMBLY_MAPS.prepare(m.total_bytes)
            self._prepared_once = self._prepared is not None  # a small payload first: wait for a pooled one
        self._start_next()
        assert t.filled == m.total_bytes  # every chunk verified
        return Completed(t.topic, m, t.payload())

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
