"""A thin paho-mqtt (MQTT v5) client: QoS 2, reconnect by itself, Last Will, TCP_NODELAY.

paho's callbacks run on its network thread, so they only put raw messages on a queue;
decoding, training and aggregation happen on the caller's thread (otherwise keepalives stall).

Every reason code >= 0x80 the broker sends (CONNACK, PUBACK/PUBREC/PUBCOMP, SUBACK, DISCONNECT) is sorted
into transient (retried with exponential backoff, logged as such) or permanent (a `PermanentBrokerError`
whose message names the cause and the fix): see fedmqtt.transport.reasons, and fedmqtt.transport.tls_diagnosis
for a failed TLS handshake.
"""

from __future__ import annotations

import collections
import logging
import queue
import re
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from fedmqtt.errors import BrokerError, PermanentBrokerError
from fedmqtt.transport.reasons import (
    MAX_BACKOFF_S,
    PERMANENT_DISCONNECTS,
    backoff_s,
    explain,
    is_transient,
    reason_code,
)
from fedmqtt.transport.settings import BrokerSettings
from fedmqtt.transport.tls_diagnosis import (
    HandshakeReset,
    explain_handshake_reset,
    explain_silent_closes,
    explain_tls,
    probe_tls,
)

log = logging.getLogger(__name__)

_WARN_EVERY_S = 30.0  # a wait for the broker says what it waits for at least this often
_SUBACK_WAIT_S = 10.0
_SILENT_CLOSES = 2  # connections closed before any CONNACK: a plaintext client on a TLS listener
# Lost this many times within this window, each time with the broker answering the reconnect at once: another
# process logs in with the same credentials (Mosquitto 2.0.11 closes the older connection without a DISCONNECT
# 0x8E, so this is the only sign).
_DUEL_LOSSES = 3
_DUEL_WINDOW_S = 60.0
_SEAT = re.compile(r"[a-z0-9]{1,16}")


class _Client(mqtt.Client):
    """paho 2.1 ignores the reason code of a PUBREC and answers PUBREL anyway; Mosquitto then completes the
    exchange with PUBCOMP 0 and paho reports a message the broker refused (0x97 quota exceeded, 0x87 not
    authorised...) as delivered. MQTT v5 (4.3.3) ends the exchange at a PUBREC >= 0x80: do that, and hand the
    code to on_publish like a PUBACK/PUBCOMP code. The code is read from the raw packet because Mosquitto
    2.0.11 also sends 0x95 (packet too large) in PUBREC, which paho's decoder rejects as malformed and answers
    by dropping the connection, then re-sending the same message for ever."""

    def _handle_pubrec(self) -> mqtt.MQTTErrorCode:
        packet = self._in_packet["packet"]
        if self._protocol == mqtt.MQTTv5 and len(packet) >= 3 and packet[2] >= 0x80:
            mid = struct.unpack("!H", bytes(packet[:2]))[0]
            with self._out_message_mutex:
                if mid in self._out_messages:
                    return self._do_on_publish(mid, reason_code(packet[2]), Properties(PacketTypes.PUBREC))
            return mqtt.MQTTErrorCode.MQTT_ERR_SUCCESS
        return super()._handle_pubrec()


@dataclass(frozen=True)
class RawMessage:
    """What arrived: the topic, the bytes, and whether the broker replayed it as retained."""

    topic: str
    payload: bytes
    retain: bool


_LOST = "lost"  # the connection dropped before the broker answered: publish again after the reconnect


class MqttTransport:
    """One MQTT v5 connection. Moves bytes only; `fedmqtt.transport.channel` adds the codec."""

    def __init__(
        self,
        settings: BrokerSettings,
        *,
        client_id: str,
        will: tuple[str, bytes] | None = None,
        inbox: queue.Queue[RawMessage] | None = None,
        seat: str | None = None,
    ) -> None:
        """`inbox`: share another connection's queue (the bulk connection feeds the control one's reader).

        `seat`: log in as `<username>.<seat>` (same password). The broker forces client id = user name
        (use_username_as_clientid, see broker/acl.py), so each simultaneous connection of one party needs its
        own user: the control connection uses the plain user name, the bulk connection the seat "bulk".
        """
        if seat is not None and not _SEAT.fullmatch(seat):
            raise ValueError(f"invalid seat {seat!r}: 1-16 of a-z, 0-9")
        self.settings = settings
        self.username = settings.username if seat is None else f"{settings.username}.{seat}"
        self.client_id = client_id
        self.broker = f"{settings.host}:{settings.port}"
        self.inbox: queue.Queue[RawMessage] = inbox if inbox is not None else queue.Queue()
        self._filters: list[str] = []
        self._connected = threading.Event()
        self._interrupted = threading.Event()  # set by a signal handler: stop waiting for the broker
        self._fatal = ""  # a permanent refusal (cause + fix): every wait raises it, retrying cannot help
        self._lock = threading.Lock()
        self._last_error = ""
        self._awaiting_connack = False
        self._silent_closes = 0  # consecutive connections closed before any CONNACK
        self._connack_failed = False  # the last CONNACK was a refusal (already logged)
        self._offline_warned_at: float | None = None
        self._losses: collections.deque[float] = collections.deque(maxlen=_DUEL_LOSSES)  # when we lost the broker
        self._duel_said_at = -_DUEL_WINDOW_S
        self._pub_failures: dict[int, ReasonCode] = {}  # mid -> refusal code of its last completion
        self._sub_mids: dict[int, list[str]] = {}
        self._sub_done: dict[int, threading.Event] = {}
        self.bytes_sent = 0
        self.connects = 0  # bumped on every (re)connect: owners re-publish what a Will overwrote
        self.bytes_received = 0
        self.refusals: dict[int, int] = {}  # reason code -> how often the broker refused something with it
        client = _Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        client.username_pw_set(self.username, settings.password)
        # Verifies the broker (CA, host name, pinned key) and, for mutual TLS, presents the certificate of this
        # connection's own user: under `broker init --mtls` the certificate is the login.
        self._ssl_context = settings.ssl_context(seat=seat)
        if self._ssl_context is not None:
            client.tls_set_context(self._ssl_context)
        if will is not None:
            client.will_set(will[0], will[1], qos=2, retain=True)
        # Backoff between reconnect attempts: quick at first, capped so a long outage costs little.
        client.reconnect_delay_set(min_delay=1, max_delay=int(MAX_BACKOFF_S))
        # Mosquitto's Receive Maximum (max_inflight_messages, 20 in mosquitto.conf). paho 2.1 neither honours the
        # one in CONNACK nor lets it be changed once connected; a broker set lower answers 0x97, which is retried.
        client.max_inflight_messages_set(20)
        client.on_pre_connect = self._on_pre_connect
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        self._client = client

    # -- paho callbacks (network thread: enqueue and record only) -------------------------------
    def _fail(self, message: str) -> None:
        """Record a permanent refusal and stop paho from reconnecting: the caller raises it."""
        if not self._fatal:
            self._fatal = message
            log.error("%s", message)
        self._interrupted.set()
        self._client.disconnect()

    def _count(self, code: int) -> None:
        self.refusals[code] = self.refusals.get(code, 0) + 1

    def _on_pre_connect(self, client, userdata) -> None:  # noqa: ANN001
        if self._ssl_context is not None and self.connects > 0:
            # A reconnect: paho would not say why a handshake fails (and leaks its socket), and a certificate
            # that expired or was replaced during the run fails the same way for ever. One handshake of our own
            # first; an OSError raised here makes paho count a failed attempt and retry with its backoff.
            try:
                probe_tls(self._ssl_context, self.settings.host, self.settings.port)
            except ssl.SSLError as exc:
                self._fail(explain_tls(exc, broker=self.broker, settings=self.settings))
                raise ConnectionAbortedError(self._fatal) from None
            except OSError as exc:
                self._last_error = str(exc)
                raise
        self._awaiting_connack = True

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        self._awaiting_connack = False
        self._silent_closes = 0
        if reason_code.is_failure:
            self._count(reason_code.value)
            self._connack_failed = True
            message = explain(f"connection as {self.username!r}", reason_code, user=self.username,
                              broker=self.broker)
            self._last_error = message
            if is_transient(reason_code.value):
                log.warning("%s", message)  # paho retries with its reconnect backoff
            else:
                self._fail(message)
            return
        self._connack_failed = False
        self._say_if_duelling()
        sock = client.socket()
        if sock is not None:
            # QoS 2 needs two round trips; Nagle would add ~30 ms to each small packet.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            filters = list(self._filters)
        if filters:
            self._send_subscribe(filters)  # SUBACK codes are checked in _on_subscribe, like the first time
        self.connects += 1
        self._connected.set()

    def _on_connect_fail(self, client, userdata) -> None:  # noqa: ANN001
        if not self._last_error:
            self._last_error = "connection attempt failed (broker down or unreachable)"

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:  # noqa: ANN001
        self._connected.clear()
        if self._awaiting_connack:
            self._silent_closes += 1  # closed before answering CONNECT: see connect()
            self._awaiting_connack = False
        if self._fatal or self._connack_failed or reason_code.value == 0:
            return  # a refusal was reported already; a clean disconnect is ours
        code = reason_code.value
        if code in PERMANENT_DISCONNECTS:
            self._count(code)
            self._fail(explain("the connection", reason_code, user=self.username, broker=self.broker))
            return
        self._last_error = str(reason_code)
        self._losses.append(time.monotonic())
        log.warning("lost the broker %s (%s); reconnecting by itself with backoff (1-%d s)", self.broker,
                    reason_code, MAX_BACKOFF_S)

    def _say_if_duelling(self) -> None:
        now = time.monotonic()
        if (len(self._losses) == _DUEL_LOSSES and now - self._losses[0] < _DUEL_WINDOW_S
                and now - self._duel_said_at >= _DUEL_WINDOW_S):
            self._duel_said_at = now
            log.error("the connection as %r to %s was closed %d times within %.0f s although the broker takes us "
                      "back at once: another process probably logs in with the same credentials (the broker keeps "
                      "only the newest connection of a user). Stop the duplicate; each party and tool needs its own "
                      "credentials (observers: observer.1 ... observer.7).", self.username, self.broker,
                      _DUEL_LOSSES, _DUEL_WINDOW_S)

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:  # noqa: ANN001
        self.bytes_received += len(message.payload)
        self.inbox.put(RawMessage(message.topic, bytes(message.payload), bool(message.retain)))

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:  # noqa: ANN001
        # Runs before paho marks the message published, so the waiter always sees the code.
        if reason_code.is_failure:
            self._count(reason_code.value)
            self._pub_failures[mid] = reason_code
        else:
            self._pub_failures.pop(mid, None)  # a stale entry of an earlier message with the same mid

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:  # noqa: ANN001
        with self._lock:
            filters = self._sub_mids.pop(mid, [])
            done = self._sub_done.pop(mid, None)
        retry: list[str] = []
        # One code per filter; strict=False so a short SUBACK from a broken broker cannot kill paho's thread.
        for topic_filter, code in zip(filters, reason_codes, strict=False):
            if not code.is_failure:
                continue
            self._count(code.value)
            message = explain(f"subscription to {topic_filter}", code, user=self.username, broker=self.broker)
            if is_transient(code.value):
                retry.append(topic_filter)
                log.warning("%s", message)
            else:
                self._fail(message)
        if retry and not self._fatal:
            timer = threading.Timer(backoff_s(self.refusals.get(0x97, 0) + len(retry)), self._resubscribe, [retry])
            timer.daemon = True
            timer.start()
        if done is not None:
            done.set()

    def _resubscribe(self, filters: list[str]) -> None:
        with self._lock:
            still = [f for f in filters if f in self._filters]
        if still and self.connected and not self._fatal:
            self._send_subscribe(still)

    def _send_subscribe(self, filters: list[str]) -> threading.Event:
        """SUBSCRIBE at QoS 2; the returned event is set when the SUBACK was checked."""
        done = threading.Event()
        with self._lock:  # held across the send so the SUBACK cannot be handled before its mid is known
            _rc, mid = self._client.subscribe([(f, 2) for f in filters])
            if mid is not None:
                self._sub_mids[mid] = list(filters)
                self._sub_done[mid] = done
        return done

    # -- public API -----------------------------------------------------------------------------
    def _raise_if_fatal(self) -> None:
        if self._fatal:
            raise PermanentBrokerError(self._fatal)

    def connect(self, *, timeout_s: float | None = 30.0) -> MqttTransport:
        """Start the network thread and wait until connected (None: wait for ever, retrying).

        Raises PermanentBrokerError at once for what retrying cannot fix (credentials, ACL, TLS problems)."""
        s = self.settings
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        next_warning = 0.0
        resets = 0
        while True:
            try:
                if self._ssl_context is not None:
                    probe_tls(self._ssl_context, s.host, s.port)
                self._client.connect(s.host, s.port, keepalive=s.keepalive_s, clean_start=True)
                break
            except ssl.SSLError as exc:  # certificate or protocol mismatch: the same next time
                raise PermanentBrokerError(explain_tls(exc, broker=self.broker, settings=s)) from None
            except OSError as exc:
                if isinstance(exc, HandshakeReset):
                    resets += 1
                    if resets >= _SILENT_CLOSES:  # twice in a row: not a restart, a listener without TLS
                        raise PermanentBrokerError(explain_handshake_reset(self.broker, exc.__cause__)) from None
                else:
                    resets = 0
                self._last_error = str(exc)
                if deadline is not None and time.monotonic() > deadline:
                    raise BrokerError(f"cannot reach the broker at {self.broker}: {exc}") from None
                if self._interrupted.is_set():
                    raise BrokerError(f"interrupted while waiting for the broker at {self.broker}") from None
                if time.monotonic() >= next_warning:  # the broker may simply not be up yet: say so, keep trying
                    log.warning("broker %s not reachable (%s); retrying", self.broker, exc)
                    next_warning = time.monotonic() + _WARN_EVERY_S
                time.sleep(1.0)
        self._client.loop_start()
        try:
            while not self.wait_connected(0.5):
                if self._silent_closes >= _SILENT_CLOSES:
                    raise PermanentBrokerError(explain_silent_closes(self.broker, self._silent_closes))
                if self._interrupted.is_set() or (deadline is not None and time.monotonic() > deadline):
                    why = self._last_error or "timed out"
                    raise BrokerError(f"could not connect to {self.broker} as {self.username!r}: {why}")
        except BrokerError:
            self.close()
            raise
        return self

    def wait_connected(self, timeout_s: float | None) -> bool:
        """True once connected; False after `timeout_s` or as soon as `interrupt()` was called.

        Raises PermanentBrokerError when the broker refused us for good; says every 30 s what it waits for."""
        start = time.monotonic()
        deadline = None if timeout_s is None else start + timeout_s
        next_warning = start + _WARN_EVERY_S
        while not self._connected.wait(0.2):
            self._raise_if_fatal()
            now = time.monotonic()
            if self._interrupted.is_set() or (deadline is not None and now > deadline):
                return False
            if now >= next_warning:
                log.warning("broker %s not reachable (%s); retrying", self.broker, self._last_error or "no answer")
                next_warning = now + _WARN_EVERY_S
        self._raise_if_fatal()
        return True

    def interrupt(self) -> None:
        """Make every wait for the broker give up now (safe from a signal handler); used on shutdown."""
        self._interrupted.set()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def subscribe(self, filters: Iterable[str]) -> None:
        """Subscribe now and again after every reconnect (retained messages are then replayed).

        Waits for the SUBACK (up to 10 s) so a refused filter raises here, with cause and fix."""
        new = [f for f in filters if f not in self._filters]
        with self._lock:
            self._filters.extend(new)
        if new and self.connected:
            self._send_subscribe(new).wait(_SUBACK_WAIT_S)
        self._raise_if_fatal()

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
            self._send_subscribe(wanted)  # not awaited: the fetcher calls this on its hot path
        self._raise_if_fatal()

    def publish_many(self, messages: Iterable[tuple[str, bytes]], *, window: int = 16, timeout_s: float = 120.0) -> int:
        """Publish retained at QoS 2 with up to `window` messages awaiting PUBCOMP (one round trip per message
        would cap a chunked model at a few MB/s). A message whose exchange broke off (connection lost) or that
        the broker refused with a transient code is re-sent one by one after a backoff, and counted only once
        the broker accepted it; a permanent refusal raises PermanentBrokerError."""
        pending: list[tuple[str, bytes, mqtt.MQTTMessageInfo]] = []
        retry: list[tuple[str, bytes]] = []
        transient: dict[int, int] = {}
        sent = 0

        def settle(item: tuple[str, bytes, mqtt.MQTTMessageInfo]) -> None:
            nonlocal sent
            topic, payload, info = item
            outcome = self._await_completion(info, time.monotonic() + timeout_s)
            if outcome is None:
                sent += len(payload)
                return
            if isinstance(outcome, ReasonCode):
                if not is_transient(outcome.value):
                    raise PermanentBrokerError(explain(f"publish to {topic}", outcome, user=self.username,
                                                       broker=self.broker))
                transient[outcome.value] = transient.get(outcome.value, 0) + 1
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
        if transient:
            codes = ", ".join(f"0x{code:02X} x{n}" for code, n in sorted(transient.items()))
            delay = backoff_s(0)
            log.warning("broker %s refused %d of the messages for now (%s, transient); re-sending them in %.1f s",
                        self.broker, sum(transient.values()), codes, delay)
            time.sleep(delay)
        for topic, payload in retry:
            self.publish(topic, payload, timeout_s=timeout_s)
            sent += len(payload)
        return sent

    def publish(self, topic: str, payload: bytes, *, retain: bool = True, timeout_s: float = 60.0) -> None:
        """Publish at QoS 2 and wait for PUBCOMP; retry across reconnects and transient refusals (with backoff)
        until `timeout_s`; a permanent refusal raises PermanentBrokerError naming cause and fix."""
        self._check_size(topic, payload)
        deadline = time.monotonic() + timeout_s
        attempt = 0
        while True:
            if not self.wait_connected(max(0.0, deadline - time.monotonic())):
                why = "interrupted" if self._interrupted.is_set() else f"not connected within {timeout_s:.0f} s"
                raise BrokerError(f"publish to {topic}: {why}")
            info = self._client.publish(topic, payload, qos=2, retain=retain)
            outcome = self._await_completion(info, deadline)
            if outcome is None:
                self.bytes_sent += len(payload)
                return
            if isinstance(outcome, ReasonCode):
                message = explain(f"publish to {topic}", outcome, user=self.username, broker=self.broker)
                if not is_transient(outcome.value):
                    raise PermanentBrokerError(message)
                delay = min(backoff_s(attempt), max(0.0, deadline - time.monotonic()))
                log.warning("%s (retry %d in %.1f s)", message, attempt + 1, delay)
                attempt += 1
                time.sleep(delay)
            if time.monotonic() > deadline:
                last = f"; last refusal: {outcome}" if isinstance(outcome, ReasonCode) else ""
                raise BrokerError(f"publish to {topic} not acknowledged within {timeout_s:.0f} s{last}")

    def _check_size(self, topic: str, payload: bytes) -> None:
        if len(payload) > self.settings.max_payload_bytes:
            raise BrokerError(f"payload of {len(payload)} bytes for {topic} exceeds max_payload_bytes "
                              f"{self.settings.max_payload_bytes}")

    def _await_completion(self, info: mqtt.MQTTMessageInfo, deadline: float) -> ReasonCode | str | None:
        """None once the broker accepted the message (PUBCOMP < 0x80); the refusal's ReasonCode if it refused
        it (paho then marks it "published" too, hence the check); _LOST if the connection dropped or time ran
        out first."""
        try:
            while not info.is_published() and self._connected.is_set() and time.monotonic() < deadline:
                info.wait_for_publish(timeout=0.5)
            if not info.is_published():
                return _LOST
        except (RuntimeError, ValueError):
            return _LOST  # not sent (no connection, queue full): the caller waits for the reconnect and retries
        return self._pub_failures.pop(info.mid, None)

    def clear_retained(self, topic: str) -> None:
        self.publish(topic, b"", retain=True)

    def get(self, timeout_s: float) -> RawMessage | None:
        """The next raw message, None after `timeout_s`; raises PermanentBrokerError once the broker refused us
        for good (e.g. a re-subscription after a reconnect), so a reader never waits in silence."""
        self._raise_if_fatal()
        try:
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            self._raise_if_fatal()
            self._say_if_still_waiting()
            return None

    def _say_if_still_waiting(self) -> None:
        """While disconnected, say at least every 30 s that we are still retrying (a reader polls get())."""
        now = time.monotonic()
        if self.connected or self._interrupted.is_set():
            self._offline_warned_at = None
        elif self._offline_warned_at is None:
            self._offline_warned_at = now  # on_disconnect said it just now
        elif now - self._offline_warned_at >= _WARN_EVERY_S:
            log.warning("broker %s not reachable (%s); retrying", self.broker, self._last_error or "no answer")
            self._offline_warned_at = now

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

    def __enter__(self) -> MqttTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
