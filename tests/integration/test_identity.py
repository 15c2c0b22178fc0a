"""No party can take over another party's MQTT connection, with a real Mosquitto and a real paho intruder.

Mosquitto ends a connection when another logs in with the same client id (and its Last Will fires); the
broker forces client id = user name (use_username_as_clientid, broker/acl.py), so an intruder that uses its
OWN valid credentials with the victim's client id only ever gets its own id.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from typing import TYPE_CHECKING

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.reasoncodes import ReasonCode

from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.mqtt import MqttTransport

if TYPE_CHECKING:
    from tests.conftest import RunningFederation


WAIT_S = 5.0
WILL = b"offline-by-will"


def _intruder(federation: RunningFederation, user: str, client_id: str) -> tuple[mqtt.Client, ReasonCode, str]:
    """Connect as `user` (its own valid password) asking for `client_id`; return the CONNACK code and the id the
    broker gave it, from the broker's log (Mosquitto 2.0.11 does not send AssignedClientIdentifier here)."""
    s = federation.settings(user)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5,
                         reconnect_on_failure=False)
    client.username_pw_set(s.username, s.password)
    answer: queue.Queue[tuple[ReasonCode, str]] = queue.Queue()
    client.on_connect = lambda _c, _u, _f, reason, props: answer.put(
        (reason, getattr(props, "AssignedClientIdentifier", client_id)))
    client.connect(s.host, s.port)
    client.loop_start()
    reason, _ = answer.get(timeout=WAIT_S)
    return client, reason, _logged_client_id(federation, user)


def _logged_client_id(federation: RunningFederation, user: str) -> str:
    """The id of the last connection of `user` in the broker's log: "New client connected from A as ID (.., u'USER')"."""
    pattern = re.compile(r"New client connected from \S+ as (\S+) \(.*u'" + re.escape(user) + r"'\)")
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = pattern.findall(federation.layout.log_path.read_text(encoding="utf-8"))
        if found:
            return found[-1]
        time.sleep(0.1)
    raise AssertionError(f"no connection of {user} in the broker log")


def _watch_status(federation: RunningFederation) -> tuple[mqtt.Client, queue.Queue[bytes]]:
    """An observer (own seat) that records every payload on ps/status."""
    s = federation.settings("observer")
    got: queue.Queue[bytes] = queue.Queue()
    subscribed = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="watch", protocol=mqtt.MQTTv5)
    client.username_pw_set("observer.1", s.password)  # a second watcher seat, so it pushes nobody off
    client.on_message = lambda _c, _u, msg: got.put(bytes(msg.payload))
    client.on_subscribe = lambda *_a: subscribed.set()
    client.on_connect = lambda c, *_a: c.subscribe(topics.ps_status_topic(federation.run_id), qos=2)
    client.connect(s.host, s.port)
    client.loop_start()
    assert subscribed.wait(WAIT_S)
    return client, got


@pytest.mark.parametrize("target", ["control", "bulk"])
@pytest.mark.parametrize("intruder_user", ["site-a", "observer"])
def test_intruder_with_own_credentials_cannot_take_over_the_ps(
    federation: RunningFederation, target: str, intruder_user: str
) -> None:
    """A site (or the observer) connecting with the PS's control or bulk client id leaves the PS connected,
    its Last Will unfired, and gets its own user name as client id."""
    # Prepare: the PS as Channel.open makes it (control with a Last Will, bulk seat), and a status watcher.
    run = federation.run_id
    status = topics.ps_status_topic(run)
    victim_id = f"fedmqtt-ps-{run}"
    ps = Channel.open(lambda **kw: MqttTransport(federation.settings("ps"), **kw), client_id=victim_id,
                      will=(status, WILL), run_id=run, sender="ps")
    ps.connect(timeout_s=10)
    watcher, seen = _watch_status(federation)
    try:
        # Execute
        wanted = victim_id if target == "control" else f"{victim_id}-bulk"
        intruder, reason, assigned = _intruder(federation, intruder_user, wanted)
        time.sleep(1.0)  # a takeover would close the victim within milliseconds

        # Assert
        assert ps.transport.connected and ps.bulk.connected
        assert ps.transport.connects == 1 and ps.bulk.connects == 1  # never dropped, never reconnected
        assert WILL not in list(seen.queue)
        assert not reason.is_failure
        assert assigned == intruder_user  # the broker replaced the requested id by the intruder's user name
        ps.transport.publish(status, b"still-here")  # and both connections still work
        ps.bulk.publish(status, b"bulk-still-here")
        deadline = time.monotonic() + WAIT_S
        payloads: list[bytes] = []
        while b"bulk-still-here" not in payloads and time.monotonic() < deadline:
            try:
                payloads.append(seen.get(timeout=0.2))
            except queue.Empty:
                pass
        assert b"still-here" in payloads and b"bulk-still-here" in payloads and WILL not in payloads
        intruder.disconnect()
        intruder.loop_stop()
    finally:
        watcher.disconnect()
        watcher.loop_stop()
        ps.close()


def test_site_cannot_take_over_another_sites_connection(federation: RunningFederation) -> None:
    """site-b using site-a's control client id does not disconnect site-a."""
    # Prepare
    run = federation.run_id
    victim = MqttTransport(federation.settings("site-a"), client_id=f"fedmqtt-site-{run}-site-a").connect(timeout_s=10)
    try:
        # Execute
        intruder, reason, assigned = _intruder(federation, "site-b", f"fedmqtt-site-{run}-site-a")
        time.sleep(1.0)

        # Assert
        assert not reason.is_failure and assigned == "site-b"
        assert victim.connected and victim.connects == 1
        intruder.disconnect()
        intruder.loop_stop()
    finally:
        victim.close()


def test_the_same_credentials_twice_are_named_as_the_cause(federation: RunningFederation, caplog) -> None:
    """A party started twice (same credentials): the broker keeps the newest login, so the two push each other
    off. Mosquitto 2.0.11 sends no DISCONNECT 0x8E; the transport notices the pattern and says what it is."""
    import logging

    # Prepare
    caplog.set_level(logging.ERROR, logger="fedmqtt.transport.mqtt")
    first = MqttTransport(federation.settings("site-a"), client_id="first").connect(timeout_s=10)
    second = MqttTransport(federation.settings("site-a"), client_id="second").connect(timeout_s=10)
    try:
        # Execute
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not any("same credentials" in r.getMessage() for r in caplog.records):
            time.sleep(0.2)

        # Assert
        said = [r.getMessage() for r in caplog.records if "same credentials" in r.getMessage()]
        assert said and "'site-a'" in said[0] and "Stop the duplicate" in said[0]
    finally:
        first.close()
        second.close()


def test_several_observers_watch_at_once(federation: RunningFederation) -> None:
    """observer, observer.1 ... observer.7 share the observer password and can all be connected at once."""
    # Prepare
    s = federation.settings("observer")
    transports = []
    try:
        # Execute
        for seat in [None, "1", "2", "7"]:
            transports.append(MqttTransport(s, client_id="dash", seat=seat).connect(timeout_s=10))
        time.sleep(0.5)

        # Assert
        assert all(t.connected and t.connects == 1 for t in transports)
        assert [t.username for t in transports] == ["observer", "observer.1", "observer.2", "observer.7"]
    finally:
        for t in transports:
            t.close()
