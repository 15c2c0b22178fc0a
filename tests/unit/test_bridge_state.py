"""A hospital broker's bridge notification ("1"/"0" on site/<id>/bridge) reaches the PS as a BridgeState; anything
else on that topic is refused and counted like any bad message; and only Mosquitto's own notification, never the
hospital broker's copy of it, reaches the central broker."""

from __future__ import annotations

from pathlib import Path

import pytest
from paho.mqtt.client import topic_matches_sub
from signed_wire import identity

from broker.bridge import write_hospital_broker
from broker.federation import init_federation
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


def test_the_bridge_notification_never_crosses_the_bridge_from_the_hospital(tmp_path: Path) -> None:
    """Mosquitto keeps a local copy of the notification whose Will "0" fires on every lost link; bridged out,
    each reconnect attempt queued it and the central broker ended up holding "0" for a hospital that was up. The
    out topics carry everything the site agent writes, and not that topic."""
    central = init_federation(tmp_path / "fed", run_id=RUN, site_ids=["site-a"], host="127.0.0.1", tls=True)
    hospital = write_hospital_broker(central.settings("site-a"), run_id=RUN, site="site-a",
                                     out_dir=tmp_path / "hospital", model_bytes=2**20)
    conf = hospital.conf_path.read_text(encoding="utf-8").splitlines()
    out = [line.split()[1] for line in conf if line.startswith("topic ") and line.split()[2] == "out"]
    assert f"notification_topic {hospital.notification_topic}" in conf
    assert not any(topic_matches_sub(f, hospital.notification_topic) for f in out), out
    written = [topics.site_status_topic(RUN, "site-a"), topics.site_update_topic(RUN, "site-a"),
               topics.chunk_topic(topics.site_update_topic(RUN, "site-a"), 7),
               topics.site_report_topic(RUN, "site-a"), topics.chunk_topic(topics.site_report_topic(RUN, "site-a"), 0)]
    for topic in written:
        assert any(topic_matches_sub(f, topic) for f in out), topic
