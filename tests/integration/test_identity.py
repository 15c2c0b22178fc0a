"""No party can take over another party's MQTT connection, with a real Mosquitto and a real paho intruder.

Mosquitto ends a connection when another logs in with the same client id (and its Last Will fires); the
broker forces client id = user name (use_username_as_clientid, broker/acl.py), so an intruder that uses its
OWN valid credentials with the victim's client id only ever gets its own id. Under `broker init --mtls` the
client certificate is the identity on every listener: a password, with another party's certificate or none,
logs in as nobody else.
"""

from __future__ import annotations

import gc
import queue
import re
import secrets
import ssl
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.reasoncodes import ReasonCode
from signed_wire import identity

from broker.config import free_port
from broker.federation import FederationLayout, init_federation
from broker.process import BrokerProcess
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


def _logged_client_id(federation: RunningFederation | FederationLayout, user: str) -> str:
    """The id of the last connection of `user` in the broker's log:
    "New client connected from A as ID (.., u'USER')"."""
    layout = federation if isinstance(federation, FederationLayout) else federation.layout
    pattern = re.compile(r"New client connected from \S+ as (\S+) \(.*u'" + re.escape(user) + r"'\)")
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = pattern.findall(layout.log_path.read_text(encoding="utf-8"))
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
    me = federation.layout.identity("ps")
    ps = Channel.open(lambda **kw: MqttTransport(federation.settings("ps"), **kw), client_id=victim_id,
                      will=(status, WILL), run_id=run, identity=me)
    will = me.seal(status, WILL)  # what the broker would publish: Channel.open signs the Will (deterministically)
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
        assert will not in list(seen.queue)
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
        assert b"still-here" in payloads and b"bulk-still-here" in payloads and will not in payloads
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


# -- mutual TLS: the certificate is the identity -------------------------------------------------------------


@pytest.fixture
def mtls(mosquitto_bin: str, tmp_path: Path) -> Iterator[FederationLayout]:
    """A `--mtls` federation on loopback (sites site-a and site-b) with its loopback listener, broker running."""
    layout = init_federation(tmp_path / "fed", run_id=f"t-{secrets.token_hex(3)}", site_ids=["site-a", "site-b"],
                             tls=True, mtls=True, port=free_port(), names=["localhost"])
    with BrokerProcess.start(layout.conf_path, port=layout.port, host=layout.listen_host):
        yield layout


def _login(host: str, port: int, user: str, password: str,
           context: ssl.SSLContext | None) -> tuple[mqtt.Client | None, object]:
    """Connect with this user name and password over `context` (None: plain TCP): the client (None if refused)
    and the CONNACK code, or the handshake's exception, or None when the broker closed without a CONNACK."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"x-{secrets.token_hex(3)}",
                         protocol=mqtt.MQTTv5, reconnect_on_failure=False)
    client.username_pw_set(user, password)
    if context is not None:
        client.tls_set_context(context)
    answer: queue.Queue[ReasonCode] = queue.Queue()
    client.on_connect = lambda _c, _u, _f, reason, _p: answer.put(reason)
    try:
        client.connect(host, port, keepalive=10)
    except OSError as exc:  # ssl.SSLError too; paho leaves that socket open: collect it quietly
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
        return None, exc
    client.loop_start()
    try:
        reason: object = answer.get(timeout=WAIT_S)
    except queue.Empty:
        reason = None
    if reason is None or getattr(reason, "is_failure", True):
        client.disconnect()
        client.loop_stop()
        return None, reason
    return client, reason


def test_a_password_with_another_sites_certificate_does_not_log_in_as_that_site(mtls: FederationLayout) -> None:
    """site-a's user name and password with site-b's valid certificate: the broker takes the certificate's word,
    so the login is site-b's. site-a's connection stays, and a publish to site-a's topics is refused. (Before,
    the password made it site-a, and the intruder pushed the real site-a off the broker.)"""
    # Prepare
    a, b = mtls.settings("site-a"), mtls.settings("site-b")
    victim = MqttTransport(a, client_id=f"fedmqtt-site-{mtls.run_id}-site-a").connect(timeout_s=10)
    try:
        # Execute
        intruder, reason = _login(a.host, a.port, "site-a", a.password, b.ssl_context())
        assert intruder is not None, reason
        published = queue.Queue()  # type: ignore[var-annotated]
        intruder.on_publish = lambda _c, _u, _mid, code, _p: published.put(code)
        intruder.publish(topics.site_status_topic(mtls.run_id, "site-a"), b"forged", qos=1)
        refusal = published.get(timeout=WAIT_S)
        time.sleep(1.0)  # a takeover would close the victim within milliseconds

        # Assert
        assert _logged_client_id(mtls, "site-b") == "site-b"
        assert refusal.value == 0x87, refusal  # not authorised: site-b may not write site-a's topics
        assert victim.connected and victim.connects == 1
        intruder.disconnect()
        intruder.loop_stop()
    finally:
        victim.close()


def test_a_password_without_a_certificate_is_refused_on_every_listener(mtls: FederationLayout) -> None:
    """Every listener of an --mtls federation, the loopback one included, refuses a right password that comes
    without a certificate. (Before, the plain loopback listener took the password alone.)"""
    a = mtls.settings("site-a")
    bare = a.model_copy(update={"tls_cert_pem": None, "tls_key_pem": None, "tls_seat_certs_pem": None})
    listeners = mtls.listeners()
    assert [li.port for li in listeners] == [mtls.port, mtls.plain_port]
    directives = [line.split()[0] for line in mtls.conf_path.read_text().splitlines() if line[:1].isalpha()]
    for needed in ("listener", "require_certificate", "use_identity_as_username"):
        assert directives.count(needed) == 2, needed
    for listener in listeners:
        for context in (bare.ssl_context(), None):  # TLS without a certificate, and plain TCP
            client, outcome = _login("127.0.0.1", listener.port, "site-a", a.password, context)
            assert client is None, (listener.describe(), outcome)
    # the control case: with its certificate, site-a gets in on both
    for listener in listeners:
        client, outcome = _login("127.0.0.1", listener.port, "site-a", a.password, a.ssl_context())
        assert client is not None, (listener.describe(), outcome)
        client.disconnect()
        client.loop_stop()


def test_each_connection_of_a_party_logs_in_with_its_own_certificate(mtls: FederationLayout) -> None:
    """A site's control and bulk connections (Channel.open) and several observers: each is its own user, so none
    pushes another off."""
    site = Channel.open(lambda **kw: MqttTransport(mtls.settings("site-a"), **kw), client_id="site",
                        will=None, run_id=mtls.run_id, identity=identity(mtls.run_id, "site-a"))
    site.connect(timeout_s=10)
    observers = [MqttTransport(mtls.settings("observer"), client_id="o", seat=seat).connect(timeout_s=10)
                 for seat in (None, "1", "7")]
    try:
        time.sleep(1.0)
        assert site.transport.connects == 1 and site.bulk.connects == 1
        assert all(o.connected and o.connects == 1 for o in observers)
        for user in ("site-a", "site-a.bulk", "observer", "observer.1", "observer.7"):
            assert _logged_client_id(mtls, user) == user
    finally:
        site.close()
        for o in observers:
            o.close()
