"""Chunked transfer against a real Mosquitto, with real paho clients as intruders.

The protocol: docs/protocol.md, "Chunked transfer"."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.mqtt import MqttTransport
from schemas import messages as m
from schemas.codec import decode, encode
from schemas.tensors import arrays_to_blobs, tensors_hash
from tests.integration.test_security import Inbox, publish

MiB = 1 << 20


def _channel(federation, user: str, *filters: str, **settings) -> Channel:
    base = federation.settings(user).model_copy(update=settings)
    tag = f"{user}-{np.random.randint(1 << 30)}"
    ch = Channel.open(lambda **kw: MqttTransport(base, **kw), client_id=tag, will=None,
                      run_id=federation.run_id, identity=federation.layout.identity(user))
    ch.connect(timeout_s=10)
    ch.transport.subscribe(filters)
    return ch


def _receive(channel: Channel, kind: type, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        inbound = channel.receive(0.2)
        if inbound is not None and isinstance(inbound.message, kind):
            return inbound
    raise AssertionError(f"no {kind.__name__} within {timeout_s} s")


def _tensors(n_bytes: int, seed: int = 0):
    return arrays_to_blobs({"w": np.random.default_rng(seed).normal(size=n_bytes // 4).astype(np.float32)})


def _broker_packet_limit(federation) -> int:
    conf = federation.layout.conf_path.read_text()
    return int(re.search(r"^max_packet_size (\d+)", conf, re.MULTILINE).group(1))


def test_model_larger_than_the_broker_packet_limit_crosses_in_chunks(federation) -> None:
    """A 40 MB model (over the broker's per-packet cap) reaches a site bit for bit through a stock Mosquitto."""
    # Prepare
    run = federation.run_id
    blobs = _tensors(40 * MiB)
    model = m.GlobalModel(run_id=run, sender="ps", round=1, model=m.ModelSpec(name="mlp"),
                          model_hash=tensors_hash(blobs), tensors=blobs)
    assert len(encode(model)) > _broker_packet_limit(federation)
    ps = _channel(federation, "ps")
    site = _channel(federation, "site-a", topics.ps_model_topic(run))
    # Execute
    sent = ps.send(topics.ps_model_topic(run), model)
    got = _receive(site, m.GlobalModel)
    # Assert: identical tensors, verified; wire bytes within 0.1% of the encoded model
    assert tensors_hash(got.message.tensors) == model.model_hash
    assert sent < len(encode(model)) * 1.001
    assert site.fetcher.stats.completed == 1 and site.fetcher.stats.failed == 0
    ps.close()
    site.close()


def test_late_site_fetches_retained_chunks_and_another_site_cannot(federation, paho_client) -> None:
    """Chunks of site-a's personalised task are retained for site-a, and the ACL keeps site-b out of them."""
    # Prepare: a task carrying 6 MB of personalised tensors, sent before anyone subscribes
    run = federation.run_id
    task_topic = topics.ps_task_topic(run, "site-a")
    task = m.TrainTask(run_id=run, sender="ps", round=1, site_id="site-a", model_hash="h" * 64,
                       deadline=time.time() + 60, settings=m.TrainSettings(), tensors=_tensors(6 * MiB))
    ps = _channel(federation, "ps")
    ps.send(task_topic, task)
    intruder = Inbox(paho_client(federation.settings("site-b")))
    # Execute
    intruder.subscribe(topics.chunk_filter(task_topic), topics.chunk_topic(task_topic, 0), task_topic)
    site = _channel(federation, "site-a", task_topic)
    got = _receive(site, m.TrainTask)
    # Assert
    assert got.message == task
    assert intruder.drain(1.0) == []
    ps.close()
    site.close()


def test_site_cannot_overwrite_a_chunk_of_the_global_model(federation, paho_client) -> None:
    # Prepare
    run = federation.run_id
    model_topic = topics.ps_model_topic(run)
    blobs = _tensors(5 * MiB)
    model = m.GlobalModel(run_id=run, sender="ps", round=1, model=m.ModelSpec(name="mlp"),
                          model_hash=tensors_hash(blobs), tensors=blobs)
    ps = _channel(federation, "ps")
    ps.send(model_topic, model)
    intruder = paho_client(federation.settings("site-a"))
    # Execute: a denied QoS-2 publish is not reported through paho, so check what a fresh reader gets
    publish(intruder, topics.chunk_topic(model_topic, 0), b"evil")
    site = _channel(federation, "site-b", model_topic)
    # Assert
    assert _receive(site, m.GlobalModel).message.model_hash == model.model_hash
    ps.close()
    site.close()


def test_tampered_chunk_is_detected_and_the_resent_update_accepted(federation, paho_client, caplog) -> None:
    """Someone with site-a's credentials overwrites chunk 1 of its update: the PS names the chunk and
    takes nothing; when site-a sends the update again, it arrives intact."""
    # Prepare
    run = federation.run_id
    topic = topics.site_update_topic(run, "site-a")
    update = m.ClientUpdate(run_id=run, sender="site-a", round=1, base_model_hash="h" * 64,
                            tensors=_tensors(6 * MiB), n_samples=10, local_steps=1)
    site = _channel(federation, "site-a")
    site.send(topic, update)
    chunk_1 = topics.chunk_topic(topic, 1)
    good = decode(_retained(paho_client, federation, chunk_1))
    tampered = encode(good.model_copy(update={"data": bytes(len(good.data))}))
    site.bulk.publish(chunk_1, tampered)  # the site's own account (a second login as site-a would push it off)
    ps = _channel(federation, "ps", topics.any_site_filter(run, "update"), chunk_refetches=1)
    # Execute
    with pytest.raises(AssertionError, match="no ClientUpdate"):
        _receive(ps, m.ClientUpdate, timeout_s=3)
    site.send(topic, update)
    got = _receive(ps, m.ClientUpdate)
    # Assert
    assert got.message == update
    assert ps.stats.rejected["chunked transfer failed"] == 1
    assert "chunk 1 of 4 fails its SHA-256 or length check" in caplog.text
    site.close()
    ps.close()


def _retained(paho_client, federation, topic: str) -> bytes:
    got = [p for t, p in _retained_messages(paho_client, federation, topic) if t == topic]
    assert got, f"nothing retained on {topic}"
    return got[0]


def _retained_messages(paho_client, federation, *filters: str) -> list[tuple[str, bytes]]:
    """What is retained under `filters`, as the PS can read it."""
    reader = Inbox(paho_client(federation.settings("ps")))
    reader.subscribe(*filters)
    got = reader.drain(2.0)
    reader.client.disconnect()  # free the "ps" login (client id = user name) for the PS channel opened next
    reader.client.loop_stop()
    return got


def test_control_messages_are_not_queued_behind_a_transfer(federation) -> None:
    """While the PS fetches a 48 MB update chunk by chunk, another site's status still reaches it first."""
    # Prepare: a small fetch window, so the transfer takes many round trips
    run = federation.run_id
    update = m.ClientUpdate(run_id=run, sender="site-a", round=1, base_model_hash="h" * 64,
                            tensors=_tensors(48 * MiB), n_samples=10, local_steps=1)
    site_a = _channel(federation, "site-a")
    site_a.send(topics.site_update_topic(run, "site-a"), update)
    ps = _channel(federation, "ps", topics.any_site_filter(run, "update"), topics.any_site_filter(run, "status"),
                  chunk_bytes=1 * MiB, fetch_window_bytes=2 * MiB)
    while not ps.fetcher.busy:
        assert ps.receive(0.05) is None
    connects = ps.transport.connects
    # Execute
    site_b = _channel(federation, "site-b")
    site_b.send(topics.site_status_topic(run, "site-b"),
                m.SiteStatus(run_id=run, sender="site-b", round=0, state="online"))
    order: list[str] = []
    deadline = time.monotonic() + 30
    while "client_update" not in order and time.monotonic() < deadline:
        inbound = ps.receive(0.2)
        if inbound is not None:
            order.append(inbound.message.kind)
    # Assert
    assert order == ["site_status", "client_update"]
    assert ps.transport.connects == connects  # the control connection never dropped
    for ch in (site_a, site_b, ps):
        ch.close()


def test_a_sender_clears_its_retained_chunked_message(federation, paho_client) -> None:
    """Channel.clear removes the manifest and every chunk a site left retained (the broker held a whole model
    for each site until its next update replaced it)."""
    # Prepare: a 12 MB update, above the 4 MB chunking threshold, retained at the broker
    run = federation.run_id
    topic = topics.site_update_topic(run, "site-a")
    update = m.ClientUpdate(run_id=run, sender="site-a", round=1, base_model_hash="h" * 64,
                            tensors=_tensors(12 * MiB), n_samples=10, local_steps=1)
    site = _channel(federation, "site-a")
    site.send(topic, update)
    before = _retained_topics(paho_client, federation, topic)
    # Execute
    site.clear(topic)
    after = _retained_topics(paho_client, federation, topic)
    # Assert: the manifest and its chunks were there, and nothing is left
    assert topic in before and sum(t.startswith(f"{topic}/chunk/") for t in before) >= 3
    assert after == []
    site.close()


def _retained_topics(paho_client, federation, topic: str) -> list[str]:
    """Topics under `topic` (itself and its chunks) with a retained, non-empty message."""
    return sorted(t for t, p in _retained_messages(paho_client, federation, topic, f"{topic}/chunk/#") if p)
