"""A hospital broker's bridge notification ("1"/"0" on site/<id>/bridge) reaches the PS as a BridgeState; anything
else on that topic is refused and counted like any bad message."""

from __future__ import annotations

import pytest
from signed_wire import identity

from fedmqtt.transport import topics
from fedmqtt.transport.channel import BridgeState, Channel
from fedmqtt.transport.memory import SIMULATION_SETTINGS, MemoryBroker, MemoryTransport
from fedmqtt.transport.mqtt import RawMessage

RUN = "r1"


def _channel() -> Channel:
    return Channel(MemoryTransport(MemoryBroker(), SIMULATION_SETTINGS, client_id="ps"), run_id=RUN,
                   identity=identity(RUN, "ps"))


@pytest.mark.parametrize(("payload", "up"), [(b"1", True), (b"0", False)])
def test_bridge_notifications_become_bridge_states(payload: bytes, up: bool) -> None:
    inbound = _channel().accept(RawMessage(topics.site_bridge_topic(RUN, "site-a"), payload, True))
    assert inbound is not None and inbound.message == BridgeState("site-a", up)
    assert inbound.topic.site_id == "site-a"


@pytest.mark.parametrize(("topic", "payload"), [
    (topics.site_bridge_topic(RUN, "site-a"), b"down"),
    (topics.site_bridge_topic(RUN, "site-a"), b'{"kind":"site_status"}'),
    (topics.site_bridge_topic("other", "site-a"), b"0"),
    ("fedmqtt/v1/r1/site/Not_A_Site/bridge", b"0"),
    ("fedmqtt/v1/r1/ps/bridge", b"0"),
])
def test_anything_else_on_a_bridge_topic_is_refused_and_counted(topic: str, payload: bytes) -> None:
    channel = _channel()
    assert channel.accept(RawMessage(topic, payload, False)) is None
    assert sum(channel.stats.rejected.values()) == 1
