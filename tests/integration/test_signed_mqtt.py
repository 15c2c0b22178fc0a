"""Signed messages against a real Mosquitto: a man in the middle (a client holding another party's broker password
but not its signing key) cannot make a receiver take a rewritten model or update; a removed site's key and a
rotated-out key are refused once `fedmqtt broker remove-site` / `rotate` (real processes, with `fedmqtt broker
start`) have published the new key list; the key list survives a broker restart with its database."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from broker.federation import FederationLayout, init_federation
from broker.process import BrokerProcess
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel, Inbound
from fedmqtt.transport.mqtt import MqttTransport, RawMessage
from fedmqtt.transport.signing import Identity
from schemas import messages as m
from schemas.codec import encode
from schemas.tensors import arrays_to_blobs, tensors_hash
from tests.integration.test_security import NOT_AUTHORIZED, Inbox, publish

pytestmark = pytest.mark.integration


def _channel(layout: FederationLayout, user: str, *filters: str, identity: Identity | None = None,
             seat: str | None = None) -> Channel:
    """One connection (control only) as `user`, verifying with its own key list."""
    t = MqttTransport(layout.settings(user), client_id=f"{user}-{np.random.randint(1 << 30)}", seat=seat)
    ch = Channel(t, run_id=layout.run_id, identity=identity or layout.identity(user))
    ch.connect(timeout_s=10)
    t.subscribe(filters)
    return ch


def _next(channel: Channel, timeout_s: float = 10.0) -> Inbound | None:
    """The next message the channel delivers within `timeout_s` (None if it refused or nothing came)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        inbound = channel.receive(0.2)
        if inbound is not None:
            return inbound
    return None


def _wait_refusals(channel: Channel, owner: str, count: int, timeout_s: float = 10.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while sum(channel.stats.rejected_by_site.get(owner, {}).values()) < count and time.monotonic() < deadline:
        assert channel.receive(0.2) is None, "a forged message was delivered"
    return dict(channel.stats.rejected_by_site.get(owner, {}))


def _model(run: str, seed: int = 0) -> m.GlobalModel:
    blobs = arrays_to_blobs({"w": np.random.default_rng(seed).normal(size=64).astype(np.float32)})
    return m.GlobalModel(run_id=run, sender="ps", round=1, model=m.ModelSpec(name="mlp"),
                         model_hash=tensors_hash(blobs), tensors=blobs)


def _flip_in_body(payload: bytes, needle: bytes) -> bytes:
    """`payload` with one byte of its body changed (inside `needle`, e.g. tensor bytes): the signature stays."""
    at = payload.index(needle) + len(needle) // 2
    return payload[:at] + bytes([payload[at] ^ 0x01]) + payload[at + 1:]


def test_a_model_rewritten_by_whoever_holds_the_ps_password_is_refused(federation, paho_client) -> None:
    """A broker-level attacker (the PS's broker password, not its signing key) replaces the retained model: the
    site takes none of its versions, and takes the PS's own model."""
    # Prepare: the PS publishes the real model; the attacker then logs in as the PS's bulk seat
    run, layout = federation.run_id, federation.layout
    model_topic = topics.ps_model_topic(run)
    ps = _channel(layout, "ps")
    real = _model(run)
    ps.send(model_topic, real)
    genuine = ps.identity.seal(model_topic, encode(real))
    mitm = paho_client(federation.settings("ps").model_copy(update={"username": "ps.bulk"}))
    site = _channel(layout, "site-a", model_topic)
    assert (got := _next(site)) is not None and got.message == real
    forged = _model(run, seed=1)
    site_a = layout.identity("site-a")
    # Execute: one byte of the tensors changed; a new model unsigned; the same signed with another party's key
    publish(mitm, model_topic, _flip_in_body(genuine, real.tensors[0].data[:16]))
    publish(mitm, model_topic, encode(forged))
    publish(mitm, model_topic, site_a.seal(model_topic, encode(forged)))
    # Assert
    assert _wait_refusals(site, "ps", 3) == {"bad signature": 1, "unsigned": 1, "wrong signer": 1}
    ps.send(model_topic, real.model_copy(update={"msg_id": "after-the-attack"}))
    assert (got := _next(site)) is not None and got.message.model_hash == real.model_hash
    for ch in (ps, site):
        ch.close()


def test_an_update_with_one_byte_changed_is_refused_by_the_ps(federation, paho_client) -> None:
    """Someone holding site-a's broker password re-publishes site-a's signed update with one tensor byte changed,
    and a chunked update's manifest with one digest changed: the PS refuses both before decoding."""
    # Prepare: site-a's real update, retained; then the attacker replaces it
    run, layout = federation.run_id, federation.layout
    topic = topics.site_update_topic(run, "site-a")
    update = m.ClientUpdate(run_id=run, sender="site-a", round=1, base_model_hash="h" * 64,
                            tensors=_model(run).tensors, n_samples=10, local_steps=1)
    site = _channel(layout, "site-a")
    site.send(topic, update)
    payload = site.identity.seal(topic, encode(update))
    site.close()
    mitm = paho_client(federation.settings("site-a"))
    ps = _channel(layout, "ps", topics.any_site_filter(run, "update"))
    assert (got := _next(ps)) is not None and got.message == update
    # Execute
    publish(mitm, topic, _flip_in_body(payload, update.tensors[0].data[:16]))
    # Assert
    assert _wait_refusals(ps, "site-a", 1) == {"bad signature": 1}
    ps.close()


def test_the_coordinators_topic_is_written_by_its_login_only(federation, paho_client) -> None:
    """Sites and observers cannot write the key list (QoS 1: 0x87); the coordinator's login can write it and
    nothing else."""
    from fedmqtt.config_io import load_toml
    from fedmqtt.transport.settings import BrokerSettings

    run = federation.run_id
    keys = topics.federation_keys_topic(run)
    reader = Inbox(paho_client(federation.settings("observer")))
    reader.subscribe(keys)
    for user, login in (("site-a", "site-a"), ("observer", "observer.1")):  # one connection per login
        intruder = paho_client(federation.settings(user).model_copy(update={"username": login}))
        assert publish(intruder, keys, b"x", qos=1).value == NOT_AUTHORIZED, user
    coordinator = paho_client(load_toml(federation.layout.coordinator.login_path, BrokerSettings, section="broker"))
    assert publish(coordinator, topics.ps_model_topic(run), b"x", qos=1).value == NOT_AUTHORIZED
    sealed = federation.layout.coordinator.sealed()
    publish(coordinator, keys, sealed)
    assert reader.wait_for(keys, sealed) == [(keys, sealed)]  # the intruders' b"x" never arrived


# -- removal and rotation on a running broker, through the CLI --------------------------------------------------
@pytest.fixture
def running(mosquitto_bin: str, tmp_path: Path) -> Iterator[FederationLayout]:
    """A federation on loopback whose broker runs under `fedmqtt broker start` (it publishes the key list)."""
    layout = init_federation(tmp_path / "fed", run_id="signed", site_ids=["site-a", "site-b"])
    proc = _start(layout)
    try:
        yield layout
    finally:
        _stop(proc)


def _start(layout: FederationLayout) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "fedmqtt", "broker", "start", "--dir", str(layout.fed_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 20
    while not layout.pid_path.is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.1)
    return proc


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=15)[0]


def _fedmqtt(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "fedmqtt", *args], capture_output=True, text=True, timeout=60,
                          check=True).stdout


def _wait_version(channel: Channel, version: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while channel.identity.ring.version < version:
        assert time.monotonic() < deadline, f"key list version {version} never arrived"
        channel.receive(0.2)


def _status(run: str, site: str, detail: str) -> m.SiteStatus:
    return m.SiteStatus(run_id=run, sender=site, round=0, state="online", detail=detail)


def test_a_removed_sites_update_is_refused_after_removal(running: FederationLayout, paho_client) -> None:
    """site-b's signed updates are accepted until `broker remove-site`; the same key's next update, put on the
    broker by someone with write rights (the PS's password), is refused once the PS has the new key list."""
    # Prepare: the PS (its control login) and a broker-level attacker (the PS's bulk login)
    run = running.run_id
    ps = _channel(running, "ps", topics.any_site_filter(run, "update"))
    mitm = paho_client(running.settings("ps").model_copy(update={"username": "ps.bulk"}))
    site_b, topic = running.identity("site-b"), topics.site_update_topic(run, "site-b")

    def update(msg_id: str) -> bytes:
        return site_b.seal(topic, encode(m.ClientUpdate(run_id=run, sender="site-b", round=1, msg_id=msg_id,
                                                         base_model_hash="h" * 64, tensors=_model(run).tensors,
                                                         n_samples=10, local_steps=1)))
    publish(mitm, topic, update("before-removal"))
    assert (got := _next(ps)) is not None and got.message.msg_id == "before-removal"
    # Execute
    out = _fedmqtt("broker", "remove-site", "--dir", str(running.fed_dir), "--site", "site-b")
    _wait_version(ps, 2)
    publish(mitm, topic, update("after-removal"))  # the reloaded ACL gives nobody write rights there any more
    late = update("after-removal-delivered-anyway")  # as if the broker itself (or a stale ACL) passed it on
    # Assert
    assert "key list version 2 published" in out
    assert _wait_refusals(ps, "site-b", 1, timeout_s=2.0) == {}  # the broker dropped it: nothing arrived
    ps.accept(RawMessage(topic, late, False))
    assert _wait_refusals(ps, "site-b", 1) == {"unknown key": 1}  # the signature layer refuses it on its own
    assert ps.identity.ring.public_key("site-b") is None
    ps.close()


def test_a_rotated_key_works_and_the_old_one_is_refused(running: FederationLayout) -> None:
    """After `broker rotate --party site-a`, what site-a's old key signs is refused, even sent over site-a's new
    broker login; what its new credentials file signs is taken."""
    # Prepare
    run = running.run_id
    ps = _channel(running, "ps", topics.any_site_filter(run, "status"))
    old_key = running.identity("site-a")
    before = _channel(running, "site-a")
    status = topics.site_status_topic(run, "site-a")
    before.send(status, _status(run, "site-a", "old key, before"))
    assert (got := _next(ps)) is not None and got.message.detail == "old key, before"
    before.close()
    # Execute
    out = _fedmqtt("broker", "rotate", "--dir", str(running.fed_dir), "--party", "site-a")
    _wait_version(ps, 2)
    stale = _channel(running, "site-a", identity=old_key)  # the new password, the old signing key
    stale.send(status, _status(run, "site-a", "old key, after"))
    refused = _wait_refusals(ps, "site-a", 1)
    stale.close()
    new = _channel(running, "site-a")  # the new credentials file: new password and new signing key
    new.send(status, _status(run, "site-a", "new key"))
    # Assert
    assert "key list version 2 published" in out
    assert refused == {"unknown key": 1}
    assert (got := _next(ps)) is not None and got.message.detail == "new key"
    assert new.identity.ring.version == 2
    for ch in (ps, new):
        ch.close()


def test_the_key_list_is_retained_across_a_broker_restart(running: FederationLayout, mosquitto_bin: str) -> None:
    """The newest key list stays at the broker (its database) when the broker restarts without the coordinator's
    tooling, and a party started afterwards with an older credentials file takes it."""
    # Prepare: version 2 published while `broker start` runs; an observer file from before
    before = running.identity("observer")
    _fedmqtt("broker", "add-site", "--dir", str(running.fed_dir), "--site", "site-c")
    pid = int(running.pid_path.read_text())
    # Execute: stop that broker (it saves its database) and start Mosquitto alone with the same config
    import os

    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    with BrokerProcess.start(running.conf_path, port=running.port):
        observer = _channel(running, "observer", identity=before, seat="1")
        _wait_version(observer, 2)
        observer.close()
    # Assert
    assert before.ring.version == 2 and before.ring.public_key("site-c") is not None
