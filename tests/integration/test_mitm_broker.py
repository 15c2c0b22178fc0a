"""A man-in-the-middle broker against real Mosquitto and real paho clients: every byte between one party and the
broker passes through a relay that reads MQTT and rewrites PUBLISH packets in flight, as whoever runs the broker
(or terminates its TLS) could. Its forgeries are as good as they get without a key: the body decodes to a valid
message whose own hashes match, the signature is the owner's original one. The receiver refuses each as a bad
signature and takes the owner's next message untouched: a model on its way down to a site, an update (its
sample count inflated) on its way up to the PS."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pytest

from broker.federation import FederationLayout
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel, Inbound
from fedmqtt.transport.mqtt import MqttTransport
from schemas import envelope
from schemas import messages as m
from schemas.codec import decode, encode
from schemas.tensors import arrays_to_blobs, tensors_hash

if TYPE_CHECKING:
    from tests.conftest import RunningFederation

pytestmark = pytest.mark.integration
PUBLISH = 3
WAIT_S = 10.0
Rewrite = Callable[[bytes], bytes]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = n >> 7, n & 0x7F
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("closed")
        data += part
    return bytes(data)


def _read_packet(sock: socket.socket) -> tuple[int, bytes]:
    """One MQTT control packet: its first byte and its body (variable header and payload)."""
    first = _read_exact(sock, 1)[0]
    length, shift = 0, 0
    while True:
        digit = _read_exact(sock, 1)[0]
        length |= (digit & 0x7F) << shift
        shift += 7
        if not digit & 0x80:
            break
    return first, _read_exact(sock, length)


@dataclass
class MitmBroker:
    """A TCP relay in front of the real broker that rewrites the payload of PUBLISH packets on `topic` going
    `towards` the client ("client", broker -> party) or the broker ("broker", party -> broker) while `armed`."""

    broker_port: int
    topic: str
    towards: str
    rewrite: Rewrite
    armed: bool = True
    limit: int | None = None  # rewrite this many and then relay as they are (None: while armed)
    rewritten: int = 0
    passed: list[str] = field(default_factory=list)  # topics of PUBLISH packets relayed in the watched direction
    _server: socket.socket = field(init=False)
    _sockets: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False

    def __post_init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self._server.getsockname()[1])

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._server.accept()
                self._keep(client)  # before connecting upstream: a refused connection still closes the client
                upstream = socket.create_connection(("127.0.0.1", self.broker_port))
                self._keep(upstream)
                threading.Thread(target=self._pump, args=(client, upstream, self.towards == "broker"),
                                 daemon=True).start()
                threading.Thread(target=self._pump, args=(upstream, client, self.towards == "client"),
                                 daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, watched: bool) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while True:
                first, body = _read_packet(src)
                if watched and first >> 4 == PUBLISH:
                    body = self._publish(first, body)
                dst.sendall(bytes([first]) + _varint(len(body)) + body)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _publish(self, first: int, body: bytes) -> bytes:
        """An MQTT v5 PUBLISH body: topic, packet id (QoS > 0), properties, then the payload."""
        topic_len = int.from_bytes(body[:2], "big")
        topic = body[2:2 + topic_len].decode("utf-8")
        at = 2 + topic_len + (2 if (first >> 1) & 0x3 else 0)
        props_len, shift, i = 0, 0, at
        while True:
            digit = body[i]
            props_len |= (digit & 0x7F) << shift
            shift, i = shift + 7, i + 1
            if not digit & 0x80:
                break
        start = i + props_len
        self.passed.append(topic)
        if not self.armed or topic != self.topic or len(body) == start:  # an empty payload clears a retained one
            return body
        if self.limit is not None and self.rewritten >= self.limit:
            return body
        self.rewritten += 1
        return body[:start] + self.rewrite(body[start:])

    def _keep(self, sock: socket.socket) -> None:
        """Every socket is closed by close(), also one accepted or connected while close() runs (no socket left
        for the garbage collector, whose ResourceWarning fails the test's teardown)."""
        with self._lock:
            self._sockets.append(sock)
            closed = self._closed
        if closed:
            sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        self._server.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()


@pytest.fixture
def mitm(federation: RunningFederation) -> Iterator[Callable[..., MitmBroker]]:
    made: list[MitmBroker] = []

    def make(topic: str, towards: str, rewrite: Rewrite) -> MitmBroker:
        made.append(MitmBroker(federation.port, topic, towards, rewrite))
        return made[-1]

    yield make
    for relay in made:
        relay.close()


def _channel(layout: FederationLayout, user: str, *filters: str, port: int | None = None) -> Channel:
    """One connection as `user` (through the relay at `port` if given), verifying with its own key list."""
    settings = layout.settings(user)
    if port is not None:
        settings = settings.model_copy(update={"port": port})
    transport = MqttTransport(settings, client_id=user)
    channel = Channel(transport, run_id=layout.run_id, identity=layout.identity(user))
    channel.connect(timeout_s=WAIT_S)
    if filters:
        transport.subscribe(filters)
    return channel


def _next(channel: Channel, timeout_s: float = WAIT_S) -> Inbound | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (inbound := channel.receive(0.2)) is not None:
            return inbound
    return None


def _refusals(channel: Channel, owner: str, count: int) -> dict[str, int]:
    """What the channel refused of `owner`'s once it has refused `count`; fails if it delivers anything."""
    deadline = time.monotonic() + WAIT_S
    while sum(channel.stats.rejected_by_site.get(owner, {}).values()) < count and time.monotonic() < deadline:
        assert channel.receive(0.2) is None, "a message rewritten in flight was delivered"
    return dict(channel.stats.rejected_by_site.get(owner, {}))


def _reseal(payload: bytes, change: Callable[[m.Message], m.Message]) -> bytes:
    """The forgery a broker can make: the signed body decoded, changed, encoded again (a valid message), with
    the owner's own signature put back on it."""
    signature, body = envelope.unseal(payload, max_bytes=len(payload))
    forged = encode(change(decode(body)))
    assert decode(forged) != decode(body)  # a different message, and a well-formed one
    return envelope.seal(forged, signature)


def _tensors(seed: int) -> tuple[m.Tensor, ...]:
    return arrays_to_blobs({"w": np.random.default_rng(seed).normal(size=256).astype(np.float32)})


def _other_weights(model: m.Message) -> m.Message:
    assert isinstance(model, m.GlobalModel)
    blobs = _tensors(666)
    return model.model_copy(update={"tensors": blobs, "model_hash": tensors_hash(blobs)})


def _more_samples(update: m.Message) -> m.Message:
    assert isinstance(update, m.ClientUpdate)
    return update.model_copy(update={"n_samples": update.n_samples * 1000, "tensors": _tensors(666)})


def test_a_model_rewritten_by_the_broker_in_flight_is_refused_by_the_site(federation: RunningFederation,
                                                                            mitm: Callable[..., MitmBroker]) -> None:
    """The PS publishes a model; between the broker and site-a it becomes other weights with a matching
    model_hash under the PS's own signature. site-a refuses it; once the relay passes bytes as they are, it
    takes the PS's next model as sent."""
    # Prepare: the PS connects to the broker directly, site-a through the relay
    run, layout = federation.run_id, federation.layout
    model_topic = topics.ps_model_topic(run)
    relay = mitm(model_topic, "client", lambda payload: _reseal(payload, _other_weights))
    ps = _channel(layout, "ps")
    site = _channel(layout, "site-a", model_topic, port=relay.port)
    blobs = _tensors(1)
    real = m.GlobalModel(run_id=run, sender="ps", round=1, model=m.ModelSpec(name="mlp"),
                         model_hash=tensors_hash(blobs), tensors=blobs)

    # Execute
    ps.send(model_topic, real)
    refused = _refusals(site, "ps", 1)
    relay.armed = False
    again = real.model_copy(update={"msg_id": "after-the-attack"})
    ps.send(model_topic, again)
    got = _next(site)

    # Assert
    assert relay.rewritten == 1 and relay.passed.count(model_topic) == 2
    assert refused == {"bad signature": 1}
    assert got is not None and got.message == again  # the relay itself delivers: the signature made the refusal
    for channel in (ps, site):
        channel.close()


def test_an_update_rewritten_by_the_broker_in_flight_is_refused_by_the_ps(federation: RunningFederation,
                                                                          mitm: Callable[..., MitmBroker]) -> None:
    """site-a's update goes up through the relay, which gives it other tensors and 1000 times the sample count
    (to outweigh every other site) under site-a's own signature. The PS refuses it; site-a's next update arrives
    as sent."""
    # Prepare: the PS connects to the broker directly, site-a through the relay
    run, layout = federation.run_id, federation.layout
    update_topic = topics.site_update_topic(run, "site-a")
    relay = mitm(update_topic, "broker", lambda payload: _reseal(payload, _more_samples))
    ps = _channel(layout, "ps", topics.any_site_filter(run, "update"))
    site = _channel(layout, "site-a", port=relay.port)
    update = m.ClientUpdate(run_id=run, sender="site-a", round=1, base_model_hash="h" * 64, tensors=_tensors(2),
                            n_samples=10, local_steps=1)

    # Execute
    site.send(update_topic, update)
    refused = _refusals(ps, "site-a", 1)
    relay.armed = False
    again = update.model_copy(update={"msg_id": "after-the-attack"})
    site.send(update_topic, again)
    got = _next(ps)

    # Assert
    assert relay.rewritten == 1 and relay.passed.count(update_topic) == 2
    assert refused == {"bad signature": 1}
    assert got is not None and got.message == again and got.message.n_samples == 10
    for channel in (ps, site):
        channel.close()
