"""Typed messages over a transport: encode on send; decode, check and de-duplicate on receive.

Every check that protects a receiver from a bad or spoofed payload lives here, so the PS and the
site agents see only messages that are well-formed, on the right topic, from the right sender.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from fedmqtt.errors import SchemaError, TopicError
from fedmqtt.transport.bulk import Completed, Failed, Fetcher, split, tensor_index as bulk_index
from fedmqtt.transport.mqtt import MqttTransport, RawMessage
from fedmqtt.transport.topics import CHUNKED_KINDS, ParsedTopic, chunk_topic, parse_topic
from schemas.chunks import MAX_CHUNK_BYTES, ChunkManifest
from schemas.codec import decode, encode

log = logging.getLogger(__name__)

# Which payload kinds may appear on which topic kind.
_KINDS_BY_TOPIC = {
    ("ps", "status"): {"daemon_status"},
    ("ps", "model"): {"global_model"},
    ("ps", "metrics"): {"round_metrics"},
    ("ps", "task"): {"train_task", "eval_task", "recruitment_result"},
    ("site", "status"): {"site_status"},
    ("site", "update"): {"client_update"},
    ("site", "report"): {"eval_report"},
}
PS_SENDER = "ps"
_STATE_KINDS = frozenset({"site_status", "daemon_status"})


@dataclass(frozen=True)
class Inbound:
    """A message that passed every check."""

    topic: ParsedTopic
    message: object
    size: int
    retained: bool


@dataclass
class ChannelStats:
    received: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0


def check_message(topic: str, payload: bytes, *, run_id: str, max_bytes: int) -> tuple[ParsedTopic, object]:
    """Decode `payload` and check it belongs on `topic`; raise SchemaError/TopicError naming the problem."""
    parsed = parse_topic(topic)
    if parsed.run_id != run_id:
        raise TopicError(f"{topic}: run {parsed.run_id!r} is not this run ({run_id!r})")
    message = decode(payload, max_bytes=max_bytes)
    kind = getattr(message, "kind")
    allowed = _KINDS_BY_TOPIC[parsed.base]
    if parsed.chunk is not None:
        allowed = {"chunk"}
    elif kind == "chunk_manifest" and parsed.base in CHUNKED_KINDS:
        kind = message.inner_kind  # type: ignore[attr-defined]
        if message.total_bytes > max_bytes:  # type: ignore[attr-defined]
            raise SchemaError(f"{topic}: chunked {kind} of {message.total_bytes} bytes exceeds the budget of "  # type: ignore[attr-defined]
                              f"{max_bytes} bytes")
    if kind not in allowed:
        raise SchemaError(f"{topic}: a {kind} does not belong on this topic (expected {sorted(allowed)})")
    if message.run_id != run_id:  # type: ignore[attr-defined]
        raise SchemaError(f"{topic}: message run_id {message.run_id!r} != {run_id!r}")  # type: ignore[attr-defined]
    expected_sender = parsed.site_id if parsed.role == "site" else PS_SENDER
    if message.sender != expected_sender:  # type: ignore[attr-defined]
        raise SchemaError(
            f"{topic}: sender {message.sender!r} claims another identity than its topic ({expected_sender!r})"  # type: ignore[attr-defined]
        )
    task_site = getattr(message, "site_id", None)
    whole = parsed.chunk is None and message.kind != "chunk_manifest"  # type: ignore[attr-defined]
    if whole and parsed.kind == "task" and task_site != parsed.site_id:
        raise SchemaError(f"{topic}: task addressed to {task_site!r} on {parsed.site_id!r}'s topic")
    return parsed, message


class Channel:
    """Send and receive typed messages of one run.

    Small messages go over `transport` (the control connection). A message whose encoding exceeds
    `chunk_threshold_bytes` goes as chunks over `bulk` (a second connection, so status, Last Will and
    keepalive never queue behind 100 MB), then its manifest over `transport`. Received chunks are fetched
    and verified by a `Fetcher` on the caller's thread; `receive` yields only whole, checked messages.
    """

    def __init__(self, transport: MqttTransport, *, run_id: str, sender: str, bulk: Any = None,
                 dedupe_window: int = 4096) -> None:
        self.transport = transport
        self.bulk = bulk if bulk is not None else transport
        self.run_id = run_id
        self.sender = sender
        self.stats = ChannelStats()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._dedupe_window = dedupe_window
        s = transport.settings
        self.fetcher = Fetcher(self.bulk, window_bytes=s.fetch_window_bytes, stall_s=s.chunk_stall_s,
                               max_refetches=s.chunk_refetches)
        self._chunks_sent: dict[str, int] = {}  # topic -> chunk count of our last transfer there

    @classmethod
    def open(cls, factory: Any, *, client_id: str, will: tuple[str, bytes] | None, run_id: str,
             sender: str) -> "Channel":
        """A control connection (with the Last Will) and a bulk one (`<client_id>-bulk`) feeding one inbox."""
        control = factory(client_id=client_id, will=will)
        bulk = factory(client_id=f"{client_id}-bulk", will=None, inbox=control.inbox)
        return cls(control, run_id=run_id, sender=sender, bulk=bulk)

    def connect(self, *, timeout_s: float | None = 30.0) -> None:
        self.transport.connect(timeout_s=timeout_s)
        if self.bulk is not self.transport:
            self.bulk.connect(timeout_s=timeout_s)

    def interrupt(self) -> None:
        self.transport.interrupt()
        if self.bulk is not self.transport:
            self.bulk.interrupt()

    def close(self, *, final: tuple[str, bytes] | None = None) -> None:
        try:
            self.transport.close(final=final)
        finally:
            if self.bulk is not self.transport:
                self.bulk.close()

    @property
    def bytes_sent(self) -> int:
        return self.transport.bytes_sent + (self.bulk.bytes_sent if self.bulk is not self.transport else 0)

    @property
    def bytes_received(self) -> int:
        return self.transport.bytes_received + (self.bulk.bytes_received if self.bulk is not self.transport else 0)

    @property
    def max_bytes(self) -> int:
        return self.transport.settings.max_payload_bytes

    def send(self, topic: str, message: object, *, retain: bool = True, payload: bytes | None = None) -> int:
        """Publish `message` (or its already-encoded `payload`, e.g. a stored uplink); returns the bytes put on
        the wire, chunks and manifest included."""
        data = payload if payload is not None else encode(message, max_bytes=self.max_bytes)
        s = self.transport.settings
        chunked = len(data) > s.chunk_threshold_bytes and parse_topic(topic).base in CHUNKED_KINDS
        if not chunked:
            self._clear_old_chunks(topic, 0)
            self.transport.publish(topic, data, retain=retain)
            return len(data)
        manifest, chunks = split(data, message, chunk_bytes=s.chunk_bytes)
        sent = self.bulk.publish_many(
            (chunk_topic(topic, c.index), encode(c, max_bytes=MAX_CHUNK_BYTES + 4096)) for c in chunks())
        self._clear_old_chunks(topic, manifest.count)
        head = encode(manifest, max_bytes=self.max_bytes)
        self.transport.publish(topic, head, retain=retain)  # last: its chunks are at the broker already
        return sent + len(head)

    def _clear_old_chunks(self, topic: str, count: int) -> None:
        """Drop retained chunks an earlier, longer transfer left behind (they would only cost broker RAM)."""
        before = self._chunks_sent.get(topic, 0)
        if before > count:
            self.bulk.publish_many((chunk_topic(topic, i), b"") for i in range(count, before))
        self._chunks_sent[topic] = count

    def receive(self, timeout_s: float) -> Inbound | None:
        """The next valid, new message, or None if none was complete within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            raw = self.transport.get(max(0.0, min(deadline - time.monotonic(), 0.5)))
            if raw is not None:
                inbound = self.accept(raw)
                if inbound is not None:
                    return inbound
            self._report(self.fetcher.tick())
            if time.monotonic() >= deadline or (raw is None and not self.fetcher.busy):
                return None

    def _report(self, outcome: Completed | Failed | None) -> Inbound | None:
        if isinstance(outcome, Failed):
            m = outcome.manifest
            self.stats.rejected["chunked transfer failed"] += 1
            log.warning("gave up on the %s from %s (round %d) on %s: %s", m.inner_kind, m.sender, m.round,
                        outcome.topic, outcome.reason)
            return None
        if isinstance(outcome, Completed):
            return self._accept_reassembled(outcome)
        return None

    def _accept_reassembled(self, done: Completed) -> Inbound | None:
        m = done.manifest
        try:
            parsed, message = check_message(done.topic, done.payload, run_id=self.run_id, max_bytes=self.max_bytes)
            if (message.kind, message.msg_id, message.round) != (m.inner_kind, m.transfer_id, m.round):  # type: ignore[attr-defined]
                raise SchemaError(f"{done.topic}: reassembled message does not match its manifest")
            if bulk_index(message) != m.tensor_index:
                raise SchemaError(f"{done.topic}: reassembled tensors do not match the manifest's tensor index")
        except (SchemaError, TopicError) as exc:
            self.stats.rejected[type(exc).__name__] += 1
            log.warning("rejected a chunked message on %s: %s", done.topic, exc)
            return None
        return self._deliver(parsed, message, len(done.payload), False)

    def accept(self, raw: RawMessage) -> Inbound | None:
        if not raw.payload:
            return None  # a cleared retained message
        self.stats.received += 1
        try:
            parsed, message = check_message(raw.topic, raw.payload, run_id=self.run_id, max_bytes=self.max_bytes)
        except (SchemaError, TopicError) as exc:
            reason = str(exc).split(":")[0] if isinstance(exc, TopicError) else type(exc).__name__
            self.stats.rejected[reason] += 1
            log.warning("rejected message on %s: %s", raw.topic, exc)
            return None
        kind = getattr(message, "kind")
        if kind == "chunk":
            assert parsed.chunk is not None
            base = raw.topic.rsplit("/", 2)[0]
            return self._report(self.fetcher.on_chunk(base, parsed.chunk, message))  # type: ignore[arg-type]
        if kind == "chunk_manifest":
            assert isinstance(message, ChunkManifest)
            if message.transfer_id in self._seen:
                self.stats.duplicates += 1
            else:
                self._report(self.fetcher.offer(raw.topic, message))
            return None
        return self._deliver(parsed, message, len(raw.payload), raw.retain)

    def _deliver(self, parsed: ParsedTopic, message: Any, size: int, retained: bool) -> Inbound | None:
        msg_id = message.msg_id
        if getattr(message, "kind") in _STATE_KINDS:
            # Statuses are idempotent state, and a Last Will re-fires with the same bytes (and id)
            # after every network loss: de-duplicating them would hide the second outage.
            return Inbound(parsed, message, size, retained)
        if msg_id in self._seen:
            self.stats.duplicates += 1
            return None
        self._seen[msg_id] = None
        if len(self._seen) > self._dedupe_window:
            self._seen.popitem(last=False)
        return Inbound(parsed, message, size, retained)
