"""Typed messages over a transport: encode on send; decode, check and de-duplicate on receive.

Every check that protects a receiver from a bad or spoofed payload lives here, so the PS and the
site agents see only messages that are well-formed, on the right topic, from the right sender, signed by that
sender's current key (fedmqtt/transport/signing.py). The signature is checked first, before the body is parsed.
A refused message is counted per sender and category (`ChannelStats`) and logged in one bounded line, at a bounded
rate (`fedmqtt.logs.RefusalLog`: the first few per sender and category, then a summary per interval); `accept`
never raises, whatever bytes arrive.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fedmqtt.errors import SchemaError, TopicError
from fedmqtt.logs import RefusalLog
from fedmqtt.transport.bulk import Completed, Failed, Fetcher, split
from fedmqtt.transport.bulk import tensor_index as bulk_index
from fedmqtt.transport.heap import release_free_heap
from fedmqtt.transport.mqtt import MqttTransport, RawMessage
from fedmqtt.transport.signing import Identity, KeyRing
from fedmqtt.transport.topics import (
    BRIDGE,
    CHUNKED_KINDS,
    ParsedTopic,
    chunk_topic,
    federation_keys_topic,
    parse_topic,
)
from schemas.chunks import MAX_CHUNK_BYTES, ChunkManifest
from schemas.codec import Encoded, WireError, clip, decode, encode, encode_pieces
from schemas.messages import Message
from schemas.signed import KeyList

log = logging.getLogger(__name__)

# Which payload kinds may appear on which topic kind (docs/protocol.md reads this table too).
KINDS_BY_TOPIC = {
    ("ps", "status"): {"daemon_status"},
    ("ps", "model"): {"global_model"},
    ("ps", "metrics"): {"round_metrics"},
    ("ps", "features"): {"feature_statistics"},
    # Secure aggregation's PS messages are addressed to one site each (the unmasking request too: on ps/model it
    # would replace the retained model a restarting site needs).
    ("ps", "task"): {"train_task", "eval_task", "recruitment_result", "secagg_roster", "secagg_inbox",
                     "secagg_unmask"},
    ("ps", "turn"): {"upload_turn"},
    ("site", "status"): {"site_status"},
    ("site", "update"): {"client_update", "secagg_masked"},
    ("site", "secagg"): {"secagg_advert", "secagg_shares", "secagg_answer"},
    ("site", "report"): {"eval_report"},
    ("site", "features"): {"feature_summary"},
    ("federation", "keys"): {"key_list"},
}
PS_SENDER = "ps"
UNKNOWN_SENDER = "?"  # the topic did not parse, so whose message it was is unknown
OTHER_SENDERS = "other"  # beyond MAX_TRACKED_SENDERS distinct senders, counted together
MAX_TRACKED_SENDERS = 1024
_STATE_KINDS = frozenset({"site_status", "daemon_status"})
# The longest topic of ours: fedmqtt/v1/<run>/site/<site>/update/chunk/<index> (8 levels, < 200 characters).
MAX_TOPIC_LEVELS = 10
MAX_TOPIC_CHARS = 256

# Rejection categories the channel adds to the codec's (schemas.codec: malformed, too large, too deep, ...).
BAD_TOPIC = "bad topic"
WRONG_RUN = "wrong run"
WRONG_TOPIC = "wrong topic"  # a kind that does not belong on that topic
WRONG_SENDER = "wrong sender"
WRONG_ADDRESS = "wrong address"  # a task on another site's topic
MANIFEST_REFUSED = "manifest refused"  # by the receiver's admission hook
OVER_BUDGET = "over budget"  # a sender's queued chunked transfers
TRANSFER_FAILED = "chunked transfer failed"
MISMATCH = "manifest mismatch"  # reassembled message differs from its manifest
INTERNAL = "internal error"


class WrongRun(TopicError):
    """A topic of another run: a configuration mix-up, not necessarily hostile."""


def rejection_category(exc: Exception) -> str:
    """The short counter key for an exception check_message raised."""
    if isinstance(exc, WireError):
        return exc.category
    if isinstance(exc, WrongRun):
        return WRONG_RUN
    if isinstance(exc, TopicError):
        return BAD_TOPIC
    return "schema"


def _parse_topic(topic: str) -> ParsedTopic:
    """parse_topic, after a cheap check of the topic's size: parse_topic takes `<topic>/chunk/<i>` apart
    recursively, and thousands of such suffixes on a topic a site may write (site/<id>/#) would otherwise end
    in a RecursionError."""
    if len(topic) > MAX_TOPIC_CHARS or topic.count("/") + 1 > MAX_TOPIC_LEVELS:
        raise TopicError(f"not a fedmqtt topic: {len(topic)} characters, {topic.count('/') + 1} levels")
    return parse_topic(topic)


def topic_owner(topic: str) -> str:
    """Who may write `topic`: its site, "ps" for ps/..., "coordinator" for the key list, "?" if it is not a topic
    of ours."""
    try:
        parsed = _parse_topic(topic)
    except TopicError:
        return UNKNOWN_SENDER
    return parsed.owner


@dataclass(frozen=True)
class Inbound:
    """A message that passed every check."""

    topic: ParsedTopic
    message: object
    size: int
    retained: bool
    chunks: int = 0  # the chunks it came in (0: one message); a receiver that clears it needs the count


@dataclass(frozen=True)
class BridgeState:
    """A hospital broker's bridge notification ("1" up, "0" down: the bridge's Will on the central broker). Not a
    schema message: Mosquitto writes it, so only these two exact payloads are taken."""

    site_id: str
    up: bool


@dataclass
class ChannelStats:
    received: int = 0
    rejected: Counter[str] = field(default_factory=Counter)  # by category, all senders together
    duplicates: int = 0
    # sender (the topic's owner) -> category -> count; both key sets are bounded (see MAX_TRACKED_SENDERS)
    rejected_by_site: dict[str, Counter[str]] = field(default_factory=dict)

    def count_rejection(self, sender: str, category: str) -> None:
        self.rejected[category] += 1
        if sender not in self.rejected_by_site and len(self.rejected_by_site) >= MAX_TRACKED_SENDERS:
            sender = OTHER_SENDERS
        self.rejected_by_site.setdefault(sender, Counter())[category] += 1


def check_message(
    topic: str, payload: bytes | bytearray, *, run_id: str, max_bytes: int, keys: KeyRing
) -> tuple[ParsedTopic, Message]:
    """Check `payload`'s signature, then decode it and check it belongs on `topic`; raise SchemaError/TopicError
    naming the problem (a WireError's `category` says which check failed). A chunk carries no signature of its
    own: its bytes are checked against the digests of its signed manifest as they arrive (transport/bulk.py)."""
    parsed = _check_topic(topic, run_id)
    if parsed.chunk is None:
        payload = keys.open(topic, parsed.owner, payload, max_bytes=max_bytes)
    return parsed, _check_body(topic, parsed, payload, run_id=run_id, max_bytes=max_bytes)


def check_vouched(topic: str, payload: bytes | bytearray | memoryview, *, run_id: str,
                  max_bytes: int) -> tuple[ParsedTopic, Message]:
    """check_message for the reassembled body of a chunked transfer, whose signed manifest's digests vouched for
    every byte of it already."""
    parsed = _check_topic(topic, run_id)
    return parsed, _check_body(topic, parsed, payload, run_id=run_id, max_bytes=max_bytes)


def _check_topic(topic: str, run_id: str) -> ParsedTopic:
    parsed = _parse_topic(topic)
    if parsed.run_id != run_id:
        raise WrongRun(f"{topic}: run {parsed.run_id!r} is not this run ({run_id!r})")
    return parsed


def _check_body(topic: str, parsed: ParsedTopic, payload: bytes | bytearray | memoryview, *, run_id: str,
                max_bytes: int) -> Message:
    message: Any = decode(payload, max_bytes=max_bytes)
    kind = message.kind
    allowed = KINDS_BY_TOPIC[parsed.base]
    if parsed.chunk is not None:
        allowed = {"chunk"}
    elif kind == "chunk_manifest" and parsed.base in CHUNKED_KINDS:
        kind = message.inner_kind
        if message.total_bytes > max_bytes:
            raise WireError("too large", f"{topic}: chunked {clip(kind, 40)} of {message.total_bytes} bytes "
                                         f"exceeds the budget of {max_bytes} bytes")
    if kind not in allowed:
        raise WireError(WRONG_TOPIC, f"{topic}: a {clip(kind, 40)} does not belong on this topic "
                                     f"(expected {sorted(allowed)})")
    if message.run_id != run_id:
        raise WireError(WRONG_RUN, f"{topic}: message run_id {message.run_id!r} != {run_id!r}")
    expected_sender = parsed.owner
    if message.sender != expected_sender:
        raise WireError(WRONG_SENDER, f"{topic}: sender {message.sender!r} claims another identity than its "
                                      f"topic ({expected_sender!r})")
    task_site = getattr(message, "site_id", None)
    whole = parsed.chunk is None and message.kind != "chunk_manifest"
    if whole and parsed.kind in ("task", "turn") and task_site != parsed.site_id:
        raise WireError(WRONG_ADDRESS, f"{topic}: task addressed to {task_site!r} on {parsed.site_id!r}'s topic")
    return message


class Channel:
    """Send and receive typed messages of one run.

    Small messages go over `transport` (the control connection). A message whose encoding exceeds
    `chunk_threshold_bytes` goes as chunks over `bulk` (a second connection, so status, Last Will and
    keepalive never queue behind 100 MB), then its manifest over `transport`. Received chunks are fetched
    and verified by a `Fetcher` on the caller's thread; `receive` yields only whole, checked messages.

    `identity` signs everything sent (a message, or a chunked one's manifest; the Last Will at connect time) and
    verifies everything received against the key list, which follows `federation/keys` by itself.
    """

    def __init__(self, transport: MqttTransport, *, run_id: str, identity: Identity, bulk: Any = None,
                 dedupe_window: int = 4096,
                 admit_manifest: Callable[[ParsedTopic, ChunkManifest], str | None] | None = None) -> None:
        """`admit_manifest(topic, manifest)`: the receiver's own judgement of a chunked transfer before a single
        chunk is fetched (e.g. the PS: wrong round, a tensor index that cannot match the model); a returned
        string refuses it and is logged as the reason."""
        self.transport = transport
        self.bulk = bulk if bulk is not None else transport
        self.run_id = run_id
        self.identity = identity
        self.stats = ChannelStats()
        self.refusals = RefusalLog(log)  # the PS logs its own refusals through it too, for one summary per site
        # Message ids already delivered, per topic owner: a party that reuses or guesses another's id on its own
        # topic must not make us drop that other party's message, nor evict the other's ids by flooding its own.
        self._seen: dict[str, OrderedDict[str, None]] = {}
        self._dedupe_window = dedupe_window
        self.admit_manifest = admit_manifest
        s = transport.settings
        self.fetcher = Fetcher(self.bulk, window_bytes=s.fetch_window_bytes, stall_s=s.chunk_stall_s,
                               max_refetches=s.chunk_refetches, max_pending_chunk_bytes=s.max_pending_chunk_bytes,
                               max_pending_manifests=s.max_pending_manifests,
                               min_rate_bytes_per_s=s.chunk_min_rate_bytes_per_s)
        self._chunks_sent: dict[str, int] = {}  # topic -> chunk count of our last transfer there

    @classmethod
    def open(cls, factory: Any, *, client_id: str, will: tuple[str, bytes] | None, run_id: str,
             identity: Identity) -> Channel:
        """A control connection (with the Last Will) and a bulk one (`<client_id>-bulk`) feeding one inbox.

        `will`: (topic, encoded message). It is signed here, once: the broker publishes it later without us, and
        its content (an "offline" status of this party) says nothing a replay could abuse (docs/threat-model.md)."""
        if will is not None:
            will = (will[0], identity.seal(will[0], will[1]))
        control = factory(client_id=client_id, will=will)
        # Its own broker user `<user>.bulk`: the broker forces client id = user name (broker/acl.py).
        bulk = factory(client_id=f"{client_id}-bulk", will=None, inbox=control.inbox, seat="bulk")
        return cls(control, run_id=run_id, identity=identity, bulk=bulk)

    def connect(self, *, timeout_s: float | None = 30.0) -> None:
        """Connect both connections and follow the key list (retained: the newest arrives at once)."""
        self.transport.connect(timeout_s=timeout_s)
        if self.bulk is not self.transport:
            self.bulk.connect(timeout_s=timeout_s)
        self.transport.subscribe([federation_keys_topic(self.run_id)])

    def interrupt(self) -> None:
        self.transport.interrupt()
        if self.bulk is not self.transport:
            self.bulk.interrupt()

    def close(self, *, final: tuple[str, bytes] | None = None) -> None:
        """`final`: (topic, encoded message) to publish before disconnecting (signed here)."""
        self.refusals.close()
        if final is not None:
            final = (final[0], self.identity.seal(final[0], final[1]))
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

    def send(self, topic: str, message: object, *, retain: bool = True, payload: Encoded | None = None) -> int:
        """Publish `message` (or its already-encoded `payload`, bytes or pieces, e.g. a stored uplink); returns the
        bytes put on the wire, chunks and manifest included."""
        if payload is None:
            pieces = encode_pieces(message, max_bytes=self.max_bytes)
        else:
            pieces = [payload] if isinstance(payload, bytes) else list(payload)
        size = sum(len(piece) for piece in pieces)
        s = self.transport.settings
        chunked = size > s.chunk_threshold_bytes and parse_topic(topic).base in CHUNKED_KINDS
        if not chunked:
            self._clear_old_chunks(topic, 0)
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            sealed = self.identity.seal(topic, bytes(data))
            self.transport.publish(topic, sealed, retain=retain)
            return len(sealed)
        # Chunks go unsigned: the manifest's SHA-256 per chunk (computed by split anyway) is signed instead, so a
        # receiver verifies one signature per transfer and every chunk by the digest it checks already.
        manifest, chunks = split(pieces, message, chunk_bytes=s.chunk_bytes)  # chunks are views: no join
        sent = self.bulk.publish_many(
            (chunk_topic(topic, c.index), encode(c, max_bytes=MAX_CHUNK_BYTES + 4096)) for c in chunks())
        self._clear_old_chunks(topic, manifest.count)
        head = self.identity.seal(topic, encode(manifest, max_bytes=self.max_bytes))
        self.transport.publish(topic, head, retain=retain)  # last: its chunks are at the broker already
        release_free_heap(size)
        return sent + len(head)

    def clear(self, topic: str) -> None:
        """Remove what this party left retained on `topic`: the message or manifest first (so nobody starts a
        fetch), then the chunks this process sent under it. A receiver ignores the empty payloads."""
        self.transport.publish(topic, b"", retain=True)
        self._clear_old_chunks(topic, 0)

    def clear_received(self, topic: str, chunks: int) -> None:
        """Remove another party's chunked message from the broker once we hold it (the PS, for an accepted update:
        it needs the sender's topics writable, which the ACL grants the PS for the whole run)."""
        self.transport.publish(topic, b"", retain=True)
        self.bulk.publish_many((chunk_topic(topic, i), b"") for i in range(chunks))

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
            self.refusals.flush()
            if time.monotonic() >= deadline or (raw is None and not self.fetcher.busy):
                return None

    def _reject(self, topic: str, category: str, reason: object) -> None:
        """Count one refused message for its topic's owner and log it: one line, bounded, whatever the input."""
        owner = topic_owner(topic)
        self.stats.count_rejection(owner, category)
        self.refusals.refused(owner, category, log, "rejected (%s) a message on %s: %s", category, clip(topic),
                              clip(reason, 1000))

    def _report(self, outcome: Completed | Failed | None) -> Inbound | None:
        if isinstance(outcome, Failed):
            m = outcome.manifest
            self._reject(outcome.topic, TRANSFER_FAILED,
                         f"gave up on the {m.inner_kind} from {m.sender} (round {m.round}): {outcome.reason}")
            return None
        if isinstance(outcome, Completed):
            inbound = self._accept_reassembled(outcome)
            release_free_heap(outcome.manifest.total_bytes)
            return inbound
        return None

    def _accept_reassembled(self, done: Completed) -> Inbound | None:
        m = done.manifest
        try:
            parsed, message = check_vouched(done.topic, done.payload, run_id=self.run_id, max_bytes=self.max_bytes)
            inner: Any = message
            if (inner.kind, inner.msg_id, inner.round) != (m.inner_kind, m.transfer_id, m.round):
                raise WireError(MISMATCH, f"{done.topic}: reassembled message does not match its manifest")
            if bulk_index(message) != m.tensor_index:
                raise WireError(MISMATCH, f"{done.topic}: reassembled tensors do not match the manifest's "
                                          "tensor index")
        except (SchemaError, TopicError) as exc:
            category = MISMATCH if rejection_category(exc) == WRONG_TOPIC else rejection_category(exc)
            self._reject(done.topic, category, f"chunked message: {exc}")
            return None
        return self._deliver(parsed, message, len(done.payload), False, chunks=m.count)

    def _bridge_state(self, raw: RawMessage) -> Inbound | None:
        site = topic_owner(raw.topic)
        try:
            owner = parse_topic(raw.topic[: -len(BRIDGE)] + "status")  # same owner and run as its status topic
        except TopicError as exc:
            self.stats.count_rejection(site, "bad topic")
            self.refusals.refused(site, "bad topic", log, "rejected (bad topic) a bridge notification on %s: %s",
                                  clip(raw.topic), clip(exc))
            return None
        if owner.run_id != self.run_id or owner.role != "site" or raw.payload not in (b"0", b"1"):
            self.stats.count_rejection(site, "malformed")
            self.refusals.refused(site, "malformed", log, "rejected (malformed) a bridge notification on %s: "
                                  "expected b'0' or b'1' of run %s", clip(raw.topic), self.run_id)
            return None
        parsed = ParsedTopic(owner.run_id, "site", BRIDGE, owner.site_id)
        return Inbound(parsed, BridgeState(owner.site_id or "?", raw.payload == b"1"), len(raw.payload), raw.retain)

    def accept(self, raw: RawMessage) -> Inbound | None:
        """Check one raw message; a whole, valid, new one comes back. Never raises: whatever the bytes, a refusal
        is counted and logged and None returned."""
        if not raw.payload:
            return None  # a cleared retained message
        self.stats.received += 1
        try:
            if raw.topic.endswith("/" + BRIDGE):
                return self._bridge_state(raw)
            return self._accept(raw)
        except Exception as exc:  # a bug of ours, never the sender's fault: keep serving everyone else
            owner = topic_owner(raw.topic)
            self.stats.count_rejection(owner, INTERNAL)
            self.refusals.refused(owner, INTERNAL, log, "internal error on a message on %s: %s", clip(raw.topic),
                                  clip(exc), exc_info=True)
            return None

    def _accept(self, raw: RawMessage) -> Inbound | None:
        try:
            parsed, message = check_message(raw.topic, raw.payload, run_id=self.run_id, max_bytes=self.max_bytes,
                                            keys=self.identity.ring)
        except (SchemaError, TopicError) as exc:
            self._reject(raw.topic, rejection_category(exc), exc)
            return None
        kind = message.kind
        if kind == "key_list":
            assert isinstance(message, KeyList)
            self.identity.ring.adopt(message, bytes(raw.payload))  # only if newer than the one we hold
            return None
        if kind == "chunk":
            assert parsed.chunk is not None
            base = raw.topic.rsplit("/", 2)[0]
            return self._report(self.fetcher.on_chunk(base, parsed.chunk, message))  # type: ignore[arg-type]
        if kind == "chunk_manifest":
            assert isinstance(message, ChunkManifest)
            self._offer(raw.topic, parsed, message)
            return None
        return self._deliver(parsed, message, len(raw.payload), raw.retain)

    def _offer(self, topic: str, parsed: ParsedTopic, manifest: ChunkManifest) -> None:
        """Queue a checked manifest for fetching, unless it is known, over its sender's budget or refused."""
        if manifest.transfer_id in self._seen.get(topic_owner(topic), ()):
            self.stats.duplicates += 1
            return
        over = self.fetcher.refusal(topic, manifest)
        if over is not None:
            self._reject(topic, OVER_BUDGET, over)
            return
        if self.admit_manifest is not None:
            reason = self.admit_manifest(parsed, manifest)
            if reason is not None:
                self._reject(topic, MANIFEST_REFUSED, f"chunked {manifest.inner_kind} of round {manifest.round}: "
                                                      f"{reason}")
                return
        self._report(self.fetcher.offer(topic, manifest))

    def _deliver(self, parsed: ParsedTopic, message: Any, size: int, retained: bool, *,
                 chunks: int = 0) -> Inbound | None:
        if message.kind in _STATE_KINDS:
            # Statuses are idempotent state, and a Last Will re-fires with the same bytes (and id)
            # after every network loss: de-duplicating them would hide the second outage.
            return Inbound(parsed, message, size, retained, chunks)
        owner = parsed.owner
        seen = self._seen.get(owner)
        if seen is None:
            if len(self._seen) >= MAX_TRACKED_SENDERS:  # only reachable without the broker's ACL
                owner = OTHER_SENDERS
            seen = self._seen.setdefault(owner, OrderedDict())
        if message.msg_id in seen:
            self.stats.duplicates += 1
            return None
        seen[message.msg_id] = None
        if len(seen) > self._dedupe_window:
            seen.popitem(last=False)
        return Inbound(parsed, message, size, retained, chunks)
