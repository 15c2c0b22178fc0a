"""Typed messages over a transport: encode on send; decode, check and de-duplicate on receive.

Every check that protects a receiver from a bad or spoofed payload lives here, so the PS and the
site agents see only messages that are well-formed, on the right topic, from the right sender.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from fedmqtt.errors import SchemaError, TopicError
from fedmqtt.transport.mqtt import MqttTransport, RawMessage
from fedmqtt.transport.topics import ParsedTopic, parse_topic
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
    allowed = _KINDS_BY_TOPIC[(parsed.role, parsed.kind)]
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
    if parsed.kind == "task" and task_site != parsed.site_id:
        raise SchemaError(f"{topic}: task addressed to {task_site!r} on {parsed.site_id!r}'s topic")
    return parsed, message


class Channel:
    """Send and receive typed messages of one run over one transport."""

    def __init__(self, transport: MqttTransport, *, run_id: str, sender: str, dedupe_window: int = 4096) -> None:
        self.transport = transport
        self.run_id = run_id
        self.sender = sender
        self.stats = ChannelStats()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._dedupe_window = dedupe_window

    @property
    def max_bytes(self) -> int:
        return self.transport.settings.max_payload_bytes

    def send(self, topic: str, message: object, *, retain: bool = True) -> int:
        data = encode(message, max_bytes=self.max_bytes)
        self.transport.publish(topic, data, retain=retain)
        return len(data)

    def receive(self, timeout_s: float) -> Inbound | None:
        """The next valid, new message, or None if none arrived within `timeout_s`."""
        raw = self.transport.get(timeout_s)
        if raw is None:
            return None
        return self.accept(raw)

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
        msg_id = message.msg_id  # type: ignore[attr-defined]
        if getattr(message, "kind") in _STATE_KINDS:
            # Statuses are idempotent state, and a Last Will re-fires with the same bytes (and id)
            # after every network loss: de-duplicating them would hide the second outage.
            return Inbound(parsed, message, len(raw.payload), raw.retain)
        if msg_id in self._seen:
            self.stats.duplicates += 1
            return None
        self._seen[msg_id] = None
        if len(self._seen) > self._dedupe_window:
            self._seen.popitem(last=False)
        return Inbound(parsed, message, len(raw.payload), raw.retain)
