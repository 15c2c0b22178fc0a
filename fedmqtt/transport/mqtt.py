"""A thin paho-mqtt (MQTT v5) client: QoS 2, reconnect by itself, Last Will, TCP_NODELAY.

paho's callbacks run on its network thread, so they only put raw messages on a queue;
decoding, training and aggregation happen on the caller's thread (otherwise keepalives stall).

Every reason code >= 0x80 the broker sends (CONNACK, PUBACK/PUBREC/PUBCOMP, SUBACK, DISCONNECT) is sorted
into transient (retried with exponential backoff, logged as such) or permanent (a `PermanentBrokerError`
whose message names the cause and the fix): see `TRANSIENT_CODES` and `_FIXES`.
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
from fedmqtt.transport.settings import BrokerSettings

log = logging.getLogger(__name__)

# Reason codes that describe a passing state of the broker: wait and try again. Everything else >= 0x80 is
# permanent: the same request would be refused again, so we stop and say what to change.
TRANSIENT_CODES = frozenset({
    0x80,  # unspecified error: Mosquitto uses it for internal hiccups (e.g. out of memory)
    0x83,  # implementation specific error: a plugin's temporary failure
    0x88,  # server unavailable
    0x89,  # server busy
    0x8B,  # server shutting down (DISCONNECT): it comes back
    0x8D,  # keep alive timeout (DISCONNECT): the network stalled; reconnect
    0x91,  # packet identifier in use: re-send under a new one
    0x92,  # packet identifier not found (e.g. after a broker restart lost the QoS 2 state): re-send
    0x93,  # receive maximum exceeded (DISCONNECT): reconnect; unacknowledged messages are re-sent
    0x96,  # message rate too high
    0x97,  # quota exceeded: the broker's in-flight/queue budget is full for now
    0x9F,  # connection rate exceeded
    0xA0,  # maximum connect time (DISCONNECT): the broker limits a connection's lifetime; reconnect
})
# DISCONNECT codes that the broker sends on purpose and that a reconnect would only repeat. A socket that
# just broke is reported by paho as 0x80 and is retried.
_PERMANENT_DISCONNECTS = frozenset({0x87, 0x8A, 0x8E, 0x95, 0x98, 0x9C, 0x9D})
_MAX_BACKOFF_S = 15.0
_WARN_EVERY_S = 30.0  # a wait for the broker says what it waits for at least this often
_SUBACK_WAIT_S = 10.0
_SILENT_CLOSES = 2  # connections closed before any CONNACK: a plaintext client on a TLS listener
# Lost this many times within this window, each time with the broker answering the reconnect at once: another
# process logs in with the same credentials (Mosquitto 2.0.11 closes the older connection without a DISCONNECT
# 0x8E, so this is the only sign).
_DUEL_LOSSES = 3
_DUEL_WINDOW_S = 60.0
_SEAT = re.compile(r"[a-z0-9]{1,16}")

# Why a permanent code happened and what to change; {user} and {broker} are filled in.
_RUN_ID_FIX = ("The broker's ACL does not grant user {user!r} that topic: check that run_id in your config "
               "matches the federation's (fedmqtt broker init --run-id ...) and that this party uses its own "
               "credentials file.")
_FIXES: dict[int, str] = {
    0x81: "The broker could not parse what we sent: check that the broker is Mosquitto 2.0 or later.",
    0x82: "The broker saw a protocol violation: check that the broker is Mosquitto 2.0 or later.",
    0x84: "The broker does not speak MQTT v5: use Mosquitto 2.0 or later.",
    0x85: "The broker refused the client id: check the broker's clientid_prefixes setting.",
    0x86: ("The broker does not know user {user!r} with this password: check the credentials file (use the one "
           "`fedmqtt broker init` wrote for this party; re-run init if the broker's password file was replaced)."),
    0x87: _RUN_ID_FIX,
    0x8A: "The broker banned this client: ask the broker's operator.",
    0x8C: ("The broker expects another authentication method: log in with the username/password from the "
           "credentials file written by `fedmqtt broker init`."),
    0x8E: ("Another connection logged in as {user!r} and the broker (use_username_as_clientid) closed ours: the "
           "same credentials are in use twice. Stop the other process; each party and tool needs its own "
           "credentials (observers: observer.1 ... observer.7 with the observer password)."),
    0x8F: "The topic filter is malformed: check run_id and site_id (1-63 of a-z, 0-9, '-').",
    0x90: "The topic name is malformed: check run_id and site_id (1-63 of a-z, 0-9, '-').",
    0x94: "The broker refused a topic alias: check that the broker is Mosquitto 2.0 or later.",
    0x95: ("The message is larger than the broker allows (message_size_limit / max_packet_size in "
           "mosquitto.conf): lower chunk_threshold_bytes and chunk_bytes in the [broker] settings below it."),
    0x98: "The broker's operator closed this connection on purpose (administrative action): ask them why.",
    0x99: "The broker refused the payload format: check that the broker is Mosquitto 2.0 or later.",
    0x9A: "The broker does not keep retained messages: set retain_available true in mosquitto.conf.",
    0x9B: "fedmqtt needs QoS 2: remove max_qos from mosquitto.conf.",
    0x9C: "The broker asks to use another server: point host/port in the [broker] settings at it.",
    0x9D: "The broker has moved: point host/port in the [broker] settings at its new address.",
    0x9E: "The broker does not support shared subscriptions: use Mosquitto 2.0 or later.",
    0xA1: "The broker does not support subscription identifiers: use Mosquitto 2.0 or later.",
    0xA2: "The broker does not support wildcard subscriptions: enable them (Mosquitto 2.0 default).",
}


def is_transient(code: int) -> bool:
    return code in TRANSIENT_CODES


def explain(action: str, reason: ReasonCode | int, *, user: str, broker: str) -> str:
    """'<action> refused: <name> (0xNN). <fix>' for a reason code >= 0x80."""
    code = reason if isinstance(reason, int) else reason.value
    name = _code_name(code) if isinstance(reason, int) else reason.getName()
    if is_transient(code):
        fix = "A transient condition of the broker: retrying with backoff."
    elif code == 0x87 and action.startswith("connection"):
        fix = (f"The broker does not let user {user!r} connect: check the credentials file (username and password "
               f"in the [broker] settings must be those `fedmqtt broker init` wrote for this party).")
    else:
        fix = _FIXES.get(code, "An unexpected refusal: see the broker's log.").format(user=user, broker=broker)
    return f"{action} refused by the broker {broker}: {name.lower()} (0x{code:02X}). {fix}"


def _code_name(code: int) -> str:
    for packet in (PacketTypes.PUBREC, PacketTypes.CONNACK, PacketTypes.SUBACK, PacketTypes.DISCONNECT):
        try:
            return ReasonCode(packet, identifier=code).getName()
        except (KeyError, ValueError):
            continue
    return "unknown reason code"


def backoff_s(attempt: int) -> float:
    """0.5, 1, 2, 4, 8, 15, 15 ... seconds: quick at first, capped so a long outage costs little."""
    return min(_MAX_BACKOFF_S, 0.5 * 2 ** min(attempt, 10))


def explain_tls(exc: ssl.SSLError, *, broker: str, settings: BrokerSettings) -> str:
    """Cause and fix of a failed TLS handshake (these never heal by retrying)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = str(exc.verify_message or exc)
        lower = why.lower()
        if "hostname mismatch" in lower or "ip address mismatch" in lower:
            fix = (f"the broker's certificate is not issued for {settings.host!r}: set host in the [broker] "
                   f"settings to a name the certificate lists (its subjectAltName), or reissue the certificate")
        elif "expired" in lower:
            fix = "the broker's certificate has expired: reissue it (and restart the broker)"
        elif "not yet valid" in lower:
            fix = "the broker's certificate is not valid yet: check the clocks of both machines"
        elif "issuer" in lower or "self-signed" in lower or "self signed" in lower:
            fix = ("the broker's certificate is not signed by the CA of the [broker] settings (tls_ca_pem or "
                   "tls_ca_file): use the federation's CA certificate (the credentials file `fedmqtt broker init` "
                   "wrote carries it)")
        else:
            fix = "check the CA of the [broker] settings (tls_ca_pem or tls_ca_file) and the broker's certificate"
        return f"TLS certificate verify failed for the broker {broker}: {why}; {fix}."
    text = str(exc)
    if isinstance(exc, ssl.SSLEOFError) or "wrong version number" in text.lower() or "record" in text.lower():
        fix = (f"is {broker} a TLS listener? Remove tls_ca_pem/tls_ca_file from the [broker] settings for a "
               f"plain listener, or use the broker's TLS port")
    elif "certificate required" in text.lower() or "unknown ca" in text.lower() or "bad certificate" in text.lower():
        fix = ("the broker wants a client certificate it trusts (mutual TLS): set tls_cert_pem/tls_key_pem (or "
               "tls_cert_file/tls_key_file) to this party's certificate from `fedmqtt broker init --mtls`")
    else:
        fix = "check the TLS settings (tls_ca_*, tls_cert_*, tls_key_*) against the broker's listener"
    return f"TLS handshake with the broker {broker} failed: {text}; {fix}."


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


def reason_code(code: int) -> ReasonCode:
    """A ReasonCode for `code`, whichever packet type paho files it under (brokers use codes out of place)."""
    for packet in (PacketTypes.PUBREC, PacketTypes.DISCONNECT, PacketTypes.CONNACK, PacketTypes.SUBACK):
        try:
            return ReasonCode(packet, identifier=code)
        except (KeyError, ValueError):
            continue
    return ReasonCode(PacketTypes.PUBREC, identifier=0x80)  # unknown to paho: "unspecified error"


@dataclass(frozen=True)
class RawMessage:
    """What arrived: the topic, the bytes, and whether the broker replayed it as retained."""

    topic: str
    payload: bytes
    retain: bool


class _HandshakeReset(ConnectionError):
    """The peer closed the connection on our TLS ClientHello (a plain listener does that)."""


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
        # Verifies the broker (CA + host name) and, for mutual TLS, presents our certificate and key.
        self._ssl_context = settings.ssl_context()
        if self._ssl_context is not None:
            client.tls_set_context(self._ssl_context)
        if will is not None:
            client.will_set(will[0], will[1], qos=2, retain=True)
        # Backoff between reconnect attempts: quick at first, capped so a long outage costs little.
        client.reconnect_delay_set(min_delay=1, max_delay=int(_MAX_BACKOFF_S))
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
                self._probe_tls(self._ssl_context)
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
        if code in _PERMANENT_DISCONNECTS:
            self._count(code)
            self._fail(explain("the connection", reason_code, user=self.username, broker=self.broker))
            return
        self._last_error = str(reason_code)
        self._losses.append(time.monotonic())
        log.warning("lost the broker %s (%s); reconnecting by itself with backoff (1-%d s)", self.broker,
                    reason_code, _MAX_BACKOFF_S)

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
        for topic_filter, code in zip(filters, reason_codes):
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
                    self._probe_tls(self._ssl_context)
                self._client.connect(s.host, s.port, keepalive=s.keepalive_s, clean_start=True)
                break
            except ssl.SSLError as exc:  # certificate or protocol mismatch: the same next time
                raise PermanentBrokerError(explain_tls(exc, broker=self.broker, settings=s)) from None
            except OSError as exc:
                if isinstance(exc, _HandshakeReset):
                    resets += 1
                    if resets >= _SILENT_CLOSES:  # twice in a row: not a restart, a listener without TLS
                        raise PermanentBrokerError(
                            f"the broker {self.broker} closed the connection during the TLS handshake "
                            f"({exc.__cause__}): is it a TLS listener? Remove tls_ca_pem/tls_ca_file from the "
                            f"[broker] settings for a plain listener, or use the broker's TLS port.") from None
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
                    raise PermanentBrokerError(
                        f"the broker {self.broker} closed the connection {self._silent_closes} times without "
                        f"answering CONNECT: is it a TLS listener? Set tls_ca_pem or tls_ca_file in the [broker] "
                        f"settings for a TLS port, or use the broker's plain port.")
                if self._interrupted.is_set() or (deadline is not None and time.monotonic() > deadline):
                    why = self._last_error or "timed out"
                    raise BrokerError(f"could not connect to {self.broker} as {self.username!r}: {why}")
        except BrokerError:
            self.close()
            raise
        return self

    def _probe_tls(self, context: ssl.SSLContext) -> None:
        """Handshake once with our own socket before paho connects: paho leaks the socket of a failed handshake,
        and a refused client certificate (TLS 1.3) only shows as an alert after the handshake, which paho would
        see as a dropped connection and retry for ever. Raises ssl.SSLError (permanent) or OSError (retry)."""
        s = self.settings
        with socket.create_connection((s.host, s.port), timeout=10.0) as raw:
            try:
                with context.wrap_socket(raw, server_hostname=s.host) as tls:
                    tls.settimeout(0.3)
                    try:
                        tls.recv(1)  # the broker says nothing before CONNECT, unless it refuses our certificate
                    except TimeoutError:
                        pass
            except (ConnectionResetError, ssl.SSLEOFError, BrokenPipeError) as exc:
                raise _HandshakeReset() from exc

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
