"""A thin paho-mqtt (MQTT v5) client: QoS 2, reconnect by itself, Last Will, TCP_NODELAY.

paho's callbacks run on its network thread, so they only put raw messages on a queue;
decoding, training and aggregation happen on the caller's thread (otherwise keepalives stall).
"""

from __future__ import annotations

import logging
import queue
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import paho.mqtt.client as mqtt
from paho.mqtt.properties import Properties
from paho.mqtt.packettypes import PacketTypes

from fedmqtt.errors import BrokerError
from fedmqtt.transport.settings import BrokerSettings

log = logging.getLogger(__name__)
# CONNACK reason codes that mean "these credentials will never work": bad user/password, not authorised.
_AUTH_FAILURES = frozenset({0x86, 0x87, 0x8C})


@dataclass(frozen=True)
class RawMessage:
    """What arrived: the topic, the bytes, and whether the broker replayed it as retained."""

    topic: str
    payload: bytes
    retain: bool


class MqttTransport:
    """One MQTT v5 connection. Moves bytes only; `fedmqtt.transport.channel` adds the codec."""

    def __init__(
        self,
        settings: BrokerSettings,
        *,
        client_id: str,
        will: tuple[str, bytes] | None = None,
        inbox: "queue.Queue[RawMessage] | None" = None,
    ) -> None:
        """`inbox`: share another connection's queue (the bulk connection feeds the control one's reader)."""
        self.settings = settings
        self.client_id = client_id
        self.inbox: queue.Queue[RawMessage] = inbox if inbox is not None else queue.Queue()
        self._filters: list[str] = []
        self._connected = threading.Event()
        self._interrupted = threading.Event()  # set by a signal handler: stop waiting for the broker
        self._refused = ""  # the broker rejected our credentials: retrying cannot help
        self._lock = threading.Lock()
        self._last_error = ""
        self.bytes_sent = 0
        self.connects = 0  # bumped on every (re)connect: owners re-publish what a Will overwrote
        self.bytes_received = 0
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        client.username_pw_set(settings.username, settings.password)
        if settings.tls_ca_file is not None:
            client.tls_set(ca_certs=str(settings.tls_ca_file), cert_reqs=ssl.CERT_REQUIRED)
        if will is not None:
            client.will_set(will[0], will[1], qos=2, retain=True)
        # Backoff between reconnect attempts: quick at first, capped so a long outage costs little.
        client.reconnect_delay_set(min_delay=1, max_delay=15)
        client.max_inflight_messages_set(20)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        self._client = client

    # -- paho callbacks (network thread: enqueue only) -------------------------------------------
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        if reason_code.is_failure:
            self._last_error = str(reason_code)
            if reason_code.value in _AUTH_FAILURES:
                self._refused = str(reason_code)
            log.warning("broker refused connection: %s", reason_code)
            return
        sock = client.socket()
        if sock is not None:
            # QoS 2 needs two round trips; Nagle would add ~30 ms to each small packet.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            filters = list(self._filters)
        if filters:
            client.subscribe([(f, 2) for f in filters])
        self.connects += 1
        self._connected.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        self._connected.clear()
        if reason_code.value != 0:
            log.warning("lost the broker (%s); reconnecting by itself", reason_code)

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:  # noqa: ANN001
        self.bytes_received += len(message.payload)
        self.inbox.put(RawMessage(message.topic, bytes(message.payload), bool(message.retain)))

    # -- public API -----------------------------------------------------------------------------
    def connect(self, *, timeout_s: float | None = 30.0) -> "MqttTransport":
        """Start the network thread and wait until connected (None: wait for ever, retrying)."""
        s = self.settings
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        next_warning = 0.0
        while True:
            try:
                self._client.connect(s.host, s.port, keepalive=s.keepalive_s, clean_start=True)
                break
            except OSError as exc:
                self._last_error = str(exc)
                if deadline is not None and time.monotonic() > deadline:
                    raise BrokerError(f"cannot reach the broker at {s.host}:{s.port}: {exc}") from None
                if self._interrupted.is_set():
                    raise BrokerError(f"interrupted while waiting for the broker at {s.host}:{s.port}") from None
                if time.monotonic() >= next_warning:  # the broker may simply not be up yet: say so, keep trying
                    log.warning("broker %s:%d not reachable (%s); retrying", s.host, s.port, exc)
                    next_warning = time.monotonic() + 30.0
                time.sleep(1.0)
        self._client.loop_start()
        while not self.wait_connected(0.5):
            if self._refused or self._interrupted.is_set() or (deadline is not None and time.monotonic() > deadline):
                self.close()
                why = f"refused: {self._refused} (check the credentials file)" if self._refused else (
                    self._last_error or "timed out")
                raise BrokerError(f"could not connect to {s.host}:{s.port} as {s.username!r}: {why}")
        return self

    def wait_connected(self, timeout_s: float | None) -> bool:
        """True once connected; False after `timeout_s` or as soon as `interrupt()` was called."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._connected.wait(0.2):
            if self._interrupted.is_set() or (deadline is not None and time.monotonic() > deadline):
                return False
        return True

    def interrupt(self) -> None:
        """Make every wait for the broker give up now (safe from a signal handler); used on shutdown."""
        self._interrupted.set()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def subscribe(self, filters: Iterable[str]) -> None:
        """Subscribe now and again after every reconnect (retained messages are then replayed)."""
        new = [f for f in filters if f not in self._filters]
        with self._lock:
            self._filters.extend(new)
        if new and self.connected:
            self._client.subscribe([(f, 2) for f in new])

    def unsubscribe(self, filters: Iterable[str]) -> None:
        gone = [f for f in filters if f in self._filters]
        with self._lock:
            self._filters = [f for f in self._filters if f not in gone]
        if gone and self.connected:
            self._client.unsubscribe(gone)

    def refetch(self, filters: Iterable[str]) -> None:
        """Subscribe again even if subscribed: the broker replays the retained messages (MQTT v5 default)."""
        wanted = list(filters)
        with self._lock:
            self._filters.extend(f for f in wanted if f not in self._filters)
        if wanted and self.connected:
            self._client.subscribe([(f, 2) for f in wanted])

    def publish_many(self, messages: Iterable[tuple[str, bytes]], *, window: int = 16, timeout_s: float = 120.0) -> int:
        """Publish retained at QoS 2 with up to `window` messages awaiting PUBCOMP (one round trip per message
        would cap a chunked model at a few MB/s); anything not acknowledged is re-sent one by one."""
        pending: list[tuple[str, bytes, mqtt.MQTTMessageInfo]] = []
        retry: list[tuple[str, bytes]] = []
        sent = 0

        def settle(item: tuple[str, bytes, mqtt.MQTTMessageInfo]) -> None:
            nonlocal sent
            topic, payload, info = item
            if self._await_pubcomp(info, time.monotonic() + timeout_s):
                sent += len(payload)
            else:
                retry.append((topic, payload))

        for topic, payload in messages:
            self._check_size(topic, payload)
            if not self.wait_connected(timeout_s):
                raise BrokerError(f"publish to {topic}: not connected within {timeout_s:.0f} s")
            pending.append((topic, payload, self._client.publish(topic, payload, qos=2, retain=True)))
            if len(pending) >= window:
                settle(pending.pop(0))
        for item in pending:
            settle(item)
        self.bytes_sent += sent
        for topic, payload in retry:  # the connection dropped under us: publish() waits for the reconnect
            self.publish(topic, payload, timeout_s=timeout_s)
            sent += len(payload)
        return sent

    def publish(self, topic: str, payload: bytes, *, retain: bool = True, timeout_s: float = 60.0) -> None:
        """Publish at QoS 2 and wait for PUBCOMP; retry across reconnects until `timeout_s`."""
        self._check_size(topic, payload)
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.wait_connected(max(0.0, deadline - time.monotonic())):
                why = "interrupted" if self._interrupted.is_set() else f"not connected within {timeout_s:.0f} s"
                raise BrokerError(f"publish to {topic}: {why}")
            info = self._client.publish(topic, payload, qos=2, retain=retain)
            if self._await_pubcomp(info, deadline):
                self.bytes_sent += len(payload)
                return
            if time.monotonic() > deadline:
                raise BrokerError(f"publish to {topic} not acknowledged within {timeout_s:.0f} s")

    def _check_size(self, topic: str, payload: bytes) -> None:
        if len(payload) > self.settings.max_payload_bytes:
            raise BrokerError(f"payload of {len(payload)} bytes for {topic} exceeds max_payload_bytes "
                              f"{self.settings.max_payload_bytes}")

    def _await_pubcomp(self, info: mqtt.MQTTMessageInfo, deadline: float) -> bool:
        """True once the broker completed the QoS-2 handshake; False if the connection dropped or time ran out."""
        while not info.is_published() and self._connected.is_set() and time.monotonic() < deadline:
            try:
                info.wait_for_publish(timeout=0.5)
            except (RuntimeError, ValueError):
                break  # the connection dropped under us: the caller waits for the reconnect and retries
        return info.is_published()

    def clear_retained(self, topic: str) -> None:
        self.publish(topic, b"", retain=True)

    def get(self, timeout_s: float) -> RawMessage | None:
        try:
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self, *, final: tuple[str, bytes] | None = None) -> None:
        """Optionally publish a last retained message (e.g. 'offline'), then disconnect cleanly."""
        try:
            if final is not None and self.connected:
                self.publish(final[0], final[1], timeout_s=3.0)
        except BrokerError as exc:
            log.warning("could not publish final status: %s", exc)
        finally:
            props = Properties(PacketTypes.DISCONNECT)
            self._client.disconnect(properties=props)
            self._client.loop_stop()

    def __enter__(self) -> "MqttTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
