"""An in-process broker and transport with MQTT's matching and retained semantics, for simulation.

`fedmqtt simulate` runs the same PS runner and site agents as a deployment, over this transport
instead of Mosquitto: messages are still encoded, validated and decoded, so the two runners
share every line of algorithm, training and codec code (and give bit-identical weights).
"""

from __future__ import annotations

import functools
import queue
from collections.abc import Iterable

from paho.mqtt.client import topic_matches_sub

from fedmqtt.errors import BrokerError
from fedmqtt.transport.mqtt import RawMessage
from fedmqtt.transport.settings import BrokerSettings

SIMULATION_SETTINGS = BrokerSettings(host="memory", port=1, username="simulation", password="simulation")


class MemoryBroker:
    """Retained messages and subscriptions of one simulated federation."""

    def __init__(self) -> None:
        self.retained: dict[str, bytes] = {}
        self.clients: list[MemoryTransport] = []

    def deliver(self, topic: str, payload: bytes, *, retain: bool) -> None:
        if retain:
            if payload:
                self.retained[topic] = payload
            else:
                self.retained.pop(topic, None)  # an empty retained message clears the topic (MQTT rule)
        for client in self.clients:
            if client.matches(topic):
                client.receive_raw(RawMessage(topic, payload, False))


class MemoryTransport:
    """Same surface as MqttTransport (publish, subscribe, get, close...), delivered in-process."""

    def __init__(self, broker: MemoryBroker, settings: BrokerSettings = SIMULATION_SETTINGS, *,
                 client_id: str = "", will: tuple[str, bytes] | None = None,
                 inbox: queue.Queue[RawMessage] | None = None, seat: str | None = None) -> None:
        self.broker = broker
        self.settings = settings
        self.client_id = client_id
        # Same login naming as MqttTransport (a second connection of one party logs in as `<user>.<seat>`).
        self.username = settings.username if seat is None else f"{settings.username}.{seat}"
        self.inbox: queue.Queue[RawMessage] = inbox if inbox is not None else queue.Queue()
        self.filters: list[str] = []
        self.connects = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self._connected = False

    def connect(self, *, timeout_s: float | None = 30.0) -> MemoryTransport:
        self.broker.clients.append(self)
        self._connected = True
        self.connects += 1
        return self

    @property
    def connected(self) -> bool:
        return self._connected

    def wait_connected(self, timeout_s: float | None) -> bool:
        return self._connected

    def interrupt(self) -> None:
        pass

    def matches(self, topic: str) -> bool:
        return any(_matches(f, topic) for f in self.filters)

    def receive_raw(self, message: RawMessage) -> None:
        self.bytes_received += len(message.payload)
        self.inbox.put(message)

    def subscribe(self, filters: Iterable[str]) -> None:
        new = [f for f in filters if f not in self.filters]
        self.filters.extend(new)
        self._replay(new)  # retained messages, as a broker does

    def unsubscribe(self, filters: Iterable[str]) -> None:
        gone = set(filters)
        self.filters = [f for f in self.filters if f not in gone]

    def refetch(self, filters: Iterable[str]) -> None:
        wanted = list(filters)
        self.filters.extend(f for f in wanted if f not in self.filters)
        self._replay(wanted)

    def _replay(self, filters: list[str]) -> None:
        """Deliver the retained messages `filters` match, in topic order. A filter without wildcards is one topic
        (looked up); only the others are matched against every retained topic (a model's chunk topics are
        subscribed to one by one, and scanning every retained topic for each cost more than the chunk)."""
        retained = self.broker.retained
        hits = {f for f in filters if not _has_wildcard(f) and f in retained}
        wild = [f for f in filters if _has_wildcard(f)]
        if wild:
            hits.update(t for t in retained if any(topic_matches_sub(f, t) for f in wild))
        for topic in sorted(hits):
            self.receive_raw(RawMessage(topic, retained[topic], True))

    def publish_many(self, messages: Iterable[tuple[str, bytes]], **_: object) -> int:
        sent = 0
        for topic, payload in messages:
            self.publish(topic, payload)
            sent += len(payload)
        return sent

    def publish(self, topic: str, payload: bytes, *, retain: bool = True, timeout_s: float = 60.0) -> None:
        if len(payload) > self.settings.max_payload_bytes:
            raise BrokerError(f"payload of {len(payload)} bytes for {topic} exceeds max_payload_bytes "
                              f"{self.settings.max_payload_bytes}")
        self.bytes_sent += len(payload)
        self.broker.deliver(topic, payload, retain=retain)

    def get(self, timeout_s: float) -> RawMessage | None:
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    def close(self, *, final: tuple[str, bytes] | None = None) -> None:
        if final is not None and self._connected:
            self.publish(final[0], final[1])
        if self in self.broker.clients:
            self.broker.clients.remove(self)
        self._connected = False


def _has_wildcard(topic_filter: str) -> bool:
    return "+" in topic_filter or "#" in topic_filter


def _matches(topic_filter: str, topic: str) -> bool:
    """MQTT matching; a filter without wildcards matches exactly its own topic."""
    return _wildcard_matches(topic_filter, topic) if _has_wildcard(topic_filter) else topic_filter == topic


@functools.lru_cache(maxsize=1 << 16)
def _wildcard_matches(topic_filter: str, topic: str) -> bool:
    """paho's matching, remembered: it builds a matcher tree per call, and every message is matched against every
    client's filters, the same topics each round (a 16 MB model's chunks cost each publishing agent about 6 ms of
    CPU a round in matching alone)."""
    return topic_matches_sub(topic_filter, topic)
