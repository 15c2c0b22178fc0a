"""MqttTransport and Channel against a real Mosquitto: retained replay, Last Will, reconnect, size budget."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fedmqtt.errors import BrokerError
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.mqtt import MqttTransport
from schemas import messages as m
from schemas.tensors import arrays_to_blobs, tensors_hash


def _channel(federation, user: str, *filters: str) -> Channel:
    t = MqttTransport(federation.settings(user), client_id=f"{user}-{np.random.randint(1 << 30)}")
    t.connect(timeout_s=10)
    t.subscribe(filters)
    return Channel(t, run_id=federation.run_id, identity=federation.layout.identity(user))


def _receive(channel: Channel, kind: type, timeout_s: float = 10.0):
    for _ in range(int(timeout_s / 0.2)):
        inbound = channel.receive(0.2)
        if inbound is not None and isinstance(inbound.message, kind):
            return inbound
    raise AssertionError(f"no {kind.__name__} within {timeout_s} s")


def test_late_subscriber_gets_the_retained_model(federation) -> None:
    """A model published before a site subscribes reaches it (retained, QoS 2), bit for bit."""
    # Prepare
    run = federation.run_id
    blobs = arrays_to_blobs({"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    model = m.GlobalModel(run_id=run, sender="ps", round=1, model=m.ModelSpec(name="mlp"),
                          model_hash=tensors_hash(blobs), tensors=blobs)
    ps = _channel(federation, "ps")
    # Execute
    ps.send(topics.ps_model_topic(run), model)
    site = _channel(federation, "site-a", topics.ps_model_topic(run))
    got = _receive(site, m.GlobalModel)
    # Assert
    assert got.retained and got.message == model
    ps.transport.close()
    site.transport.close()


def test_will_says_offline_when_a_site_process_is_killed(federation) -> None:
    """SIGKILL of a connected site process makes the broker publish its retained 'offline' status (signed by the
    site when it connected, so the PS takes it like any signed status)."""
    # Prepare: a real separate process holding site-a's connection with its Last Will.
    ps = _channel(federation, "ps", topics.any_site_filter(federation.run_id, "status"))
    creds = federation.layout.credentials["site-a"]
    code = textwrap.dedent(f"""
        import sys, time
        from fedmqtt.config_io import load_toml
        from fedmqtt.transport.settings import BrokerSettings
        from fedmqtt.transport.mqtt import MqttTransport
        from fedmqtt.transport.signing import load_identity
        from fedmqtt.transport import topics
        from schemas import messages as m
        from schemas.codec import encode
        s = load_toml({str(creds)!r}, BrokerSettings, section="broker")
        me = load_identity({str(creds)!r}, run_id={federation.run_id!r})
        topic = topics.site_status_topic({federation.run_id!r}, "site-a")
        will = encode(m.SiteStatus(run_id={federation.run_id!r}, sender="site-a", round=0, state="offline"))
        t = MqttTransport(s, client_id="site-a-proc", will=(topic, me.seal(topic, will))).connect()
        online = m.SiteStatus(run_id={federation.run_id!r}, sender="site-a", round=0, state="online")
        t.publish(topic, me.seal(topic, encode(online)))
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    assert _receive(ps, m.SiteStatus).message.state == "online"
    # Execute
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    proc.stdout.close()
    # Assert
    assert _receive(ps, m.SiteStatus).message.state == "offline"
    ps.transport.close()


def test_transport_reconnects_after_a_broker_restart(federation) -> None:
    """After the broker restarts, a client reconnects and re-subscribes by itself."""
    # Prepare
    run = federation.run_id
    site = _channel(federation, "site-a", topics.ps_status_topic(run))
    connects = site.transport.connects
    # Execute
    federation.restart()
    for _ in range(200):
        if site.transport.connects > connects and site.transport.connected:
            break
        site.receive(0.1)
    ps = _channel(federation, "ps")
    ps.send(topics.ps_status_topic(run), m.DaemonStatus(run_id=run, sender="ps", round=3, state="training"))
    # Assert
    assert site.transport.connects == connects + 1
    got = _receive(site, m.DaemonStatus, timeout_s=20)
    assert got.message.round == 3
    site.transport.close()
    ps.transport.close()


def test_publish_over_the_budget_is_refused_before_sending(federation) -> None:
    """A payload above max_payload_bytes raises a clear BrokerError instead of being dropped by the broker."""
    # Prepare
    settings = federation.settings("site-a").model_copy(update={"max_payload_bytes": 2048})
    t = MqttTransport(settings, client_id="site-a-budget").connect(timeout_s=10)
    # Execute / Assert
    with pytest.raises(BrokerError, match="exceeds max_payload_bytes 2048"):
        t.publish(topics.site_update_topic(federation.run_id, "site-a"), b"x" * 4096)
    t.close()


def test_wrong_password_fails_fast_with_a_clear_error(federation) -> None:
    """Credentials the broker refuses end the connect at once, naming the user, instead of retrying for ever."""
    # Prepare
    settings = federation.settings("site-a").model_copy(update={"password": "wrong"})
    # Execute / Assert
    with pytest.raises(BrokerError, match="'site-a'.*refused.*check the credentials file"):
        MqttTransport(settings, client_id="site-a-wrong").connect(timeout_s=None)


def test_a_broker_outage_is_retried_and_said_every_period(federation, caplog, monkeypatch) -> None:
    """While the broker is down a reader polling get() keeps retrying and says so (every 30 s; shortened here),
    then reconnects by itself: an outage is transient, never a PermanentBrokerError."""
    import logging
    import time

    import fedmqtt.transport.mqtt as transport_module

    # Prepare
    monkeypatch.setattr(transport_module, "_WARN_EVERY_S", 0.5)
    site = MqttTransport(federation.settings("site-a"), client_id="x").connect(timeout_s=10)
    caplog.set_level(logging.WARNING, logger="fedmqtt.transport.mqtt")
    try:
        # Execute
        federation.broker.stop()
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            assert site.get(0.1) is None
        federation.restart()  # stop() on a stopped broker is a no-op; starts it again on the same port
        end = time.monotonic() + 20
        while not site.connected and time.monotonic() < end:
            site.get(0.1)
        # Assert
        said = [r.getMessage() for r in caplog.records]
        assert any("lost the broker" in line and "reconnecting" in line for line in said)
        assert sum("not reachable" in line and "retrying" in line for line in said) >= 2
        assert site.connected and site.connects == 2
    finally:
        site.close()
