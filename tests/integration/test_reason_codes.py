"""Reason codes >= 0x80 with a real Mosquitto 2.0.11: transient ones are retried, permanent ones fail fast with
cause and fix. Each test starts its own broker whose configuration provokes the code (tiny quota, size limit,
ACL), with the same users, ACL and forced client ids as a federation."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from broker.acl import LISTENER_IDENTITY_LINES, render_acl
from broker.config import broker_user, free_port
from broker.passwords import write_password_file
from broker.process import BrokerProcess
from fedmqtt.errors import PermanentBrokerError
from fedmqtt.transport import topics
from fedmqtt.transport.mqtt import MqttTransport
from fedmqtt.transport.reasons import explain, is_transient
from fedmqtt.transport.settings import BrokerSettings

RUN = "rc-run"
PASSWORDS = {"ps": secrets.token_urlsafe(16), "observer": secrets.token_urlsafe(16),
             "site-a": secrets.token_urlsafe(16)}


class Broker:
    """A Mosquitto with the run's password file and ACL plus `extra` lines, on a free loopback port."""

    def __init__(self, tmp_path: Path, extra: list[str], mosquitto_bin: str) -> None:
        self.port = free_port()
        write_password_file(tmp_path / "passwd", PASSWORDS)
        (tmp_path / "acl").write_text(render_acl(RUN, ["site-a"]), encoding="utf-8")
        self.log_path = tmp_path / "mosquitto.log"
        conf = [
            "allow_anonymous false",
            "per_listener_settings false",
            f"listener {self.port} 127.0.0.1",
            *LISTENER_IDENTITY_LINES,
            f"password_file {tmp_path / 'passwd'}",
            f"acl_file {tmp_path / 'acl'}",
            f"log_dest file {self.log_path}",
            "log_type all",
            f"user {broker_user()}",
            *extra,
        ]
        (tmp_path / "mosquitto.conf").write_text("\n".join(conf) + "\n", encoding="utf-8")
        self.process = BrokerProcess.start(tmp_path / "mosquitto.conf", port=self.port)

    def settings(self, user: str, **overrides: object) -> BrokerSettings:
        return BrokerSettings(host="127.0.0.1", port=self.port, username=user, password=PASSWORDS[user],
                              **overrides)


@pytest.fixture
def broker_with(tmp_path: Path, mosquitto_bin: str) -> Iterator:
    started: list[Broker] = []

    def start(*extra: str) -> Broker:
        started.append(Broker(tmp_path, list(extra), mosquitto_bin))
        return started[-1]

    yield start
    for b in started:
        b.process.stop()


def test_quota_exceeded_is_retried_and_every_chunk_arrives(broker_with, caplog: pytest.LogCaptureFixture) -> None:
    """Receive Maximum 2: Mosquitto answers PUBREC 0x97 to QoS 2 publishes beyond it (paho would count them as
    delivered). publish_many re-sends them after a backoff, logs that it does, and counts each chunk once."""
    # Prepare
    broker = broker_with("max_inflight_messages 2")
    base = topics.ps_model_topic(RUN)
    messages = [(topics.chunk_topic(base, i), secrets.token_bytes(2000)) for i in range(40)]
    ps = MqttTransport(broker.settings("ps"), client_id="ps").connect(timeout_s=10)
    reader = MqttTransport(broker.settings("ps"), client_id="reader", seat="bulk").connect(timeout_s=10)
    caplog.set_level(logging.WARNING, logger="fedmqtt.transport.mqtt")
    try:
        # Execute
        sent = ps.publish_many(messages, window=16, timeout_s=30)
        reader.subscribe([topics.chunk_filter(base)])
        got: dict[str, bytes] = {}
        deadline = time.monotonic() + 10
        while len(got) < len(messages) and time.monotonic() < deadline:
            raw = reader.get(0.2)
            if raw is not None:
                got[raw.topic] = raw.payload

        # Assert
        assert sorted(got) == sorted(dict(messages))  # no chunk lost (plain paho loses the refused ones)
        assert got == dict(messages)  # every chunk is retained at the broker, bit for bit
        assert ps.refusals.get(0x97, 0) > 0, "the broker never refused: the test proves nothing"
        assert sent == sum(len(p) for _, p in messages) == ps.bytes_sent  # each chunk counted exactly once
        assert any("0x97" in r.getMessage() and "transient" in r.getMessage() and "re-sending" in r.getMessage()
                   for r in caplog.records)
    finally:
        ps.close()
        reader.close()


def test_publish_refused_by_the_acl_fails_fast_with_run_id_fix(broker_with) -> None:
    """A site whose run id is mistyped publishes outside its ACL: PUBREC 0x87 raises at once, naming the fix."""
    # Prepare
    broker = broker_with()
    site = MqttTransport(broker.settings("site-a"), client_id="site").connect(timeout_s=10)
    wrong_run = topics.site_status_topic("rc-rnu", "site-a")
    try:
        # Execute
        start = time.monotonic()
        with pytest.raises(PermanentBrokerError) as caught:
            site.publish(wrong_run, b"online", timeout_s=30)
        with pytest.raises(PermanentBrokerError, match=r"0x87"):
            site.publish_many([(f"{wrong_run}/chunk/{i}", b"x") for i in range(5)], timeout_s=30)

        # Assert
        message = str(caught.value)
        assert time.monotonic() - start < 5
        assert f"publish to {wrong_run}" in message and "not authorized (0x87)" in message
        assert "run_id" in message and "fedmqtt broker init --run-id" in message
        assert site.connected  # a refusal is not a disconnect
        site.publish(topics.site_status_topic(RUN, "site-a"), b"online", timeout_s=5)  # own topic works
    finally:
        site.close()


def test_packet_too_large_fails_fast_with_chunk_size_fix(broker_with) -> None:
    """message_size_limit: Mosquitto answers PUBREC 0x95; the error names the settings to lower."""
    # Prepare
    broker = broker_with("message_size_limit 1000")
    ps = MqttTransport(broker.settings("ps"), client_id="ps").connect(timeout_s=10)
    try:
        # Execute / Assert
        with pytest.raises(PermanentBrokerError, match=r"packet too large \(0x95\).*chunk_bytes"):
            ps.publish(topics.ps_model_topic(RUN), b"x" * 2000, timeout_s=30)
        assert ps.bytes_sent == 0
    finally:
        ps.close()


@pytest.mark.parametrize("user,password", [("site-a", "wrong-password"), ("nobody", "x")])
def test_bad_credentials_fail_fast_without_a_protocol_error_line(
    broker_with, caplog: pytest.LogCaptureFixture, user: str, password: str
) -> None:
    """A refused CONNECT raises within seconds (not after the 30 s timeout) naming the credentials file, and
    never first logs a disconnect/reconnect line."""
    # Prepare
    broker = broker_with()
    settings = BrokerSettings(host="127.0.0.1", port=broker.port, username=user, password=password)
    caplog.set_level(logging.INFO)
    # Execute
    start = time.monotonic()
    with pytest.raises(PermanentBrokerError) as caught:
        MqttTransport(settings, client_id="x").connect(timeout_s=30)
    # Assert
    assert time.monotonic() - start < 5
    assert "(0x86)" in str(caught.value) or "(0x87)" in str(caught.value)
    assert "credentials file" in str(caught.value)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "Protocol error" not in logged and "reconnecting" not in logged


def test_mosquitto_2_0_11_grants_an_acl_refused_subscription(broker_with) -> None:
    """What Mosquitto 2.0.11 really does: with an acl_file it grants QoS 2 to a subscription the ACL does not
    allow to read (and then delivers nothing). A mistyped run id is therefore caught by the site's first
    publish (0x87 above), not by SUBACK; SUBACK codes are still checked for brokers that do refuse."""
    # Prepare
    broker = broker_with()
    site = MqttTransport(broker.settings("site-a"), client_id="site").connect(timeout_s=10)
    codes: list[int] = []
    done = threading.Event()
    site._client.on_subscribe = lambda _c, _u, _m, reasons, _p: (codes.extend(r.value for r in reasons), done.set())
    try:
        # Execute
        site._client.subscribe([(f"{topics.run_prefix('rc-rnu')}/ps/model", 2)])
        # Assert
        assert done.wait(5) and codes == [2]
    finally:
        site.close()


@pytest.mark.parametrize("code,transient", [(0x87, False), (0x8F, False), (0x97, True), (0x80, True)])
def test_suback_codes_are_sorted_into_retry_or_fail(broker_with, code: int, transient: bool) -> None:
    """A SUBACK code >= 0x80 (fed to the transport's SUBACK handler, since Mosquitto 2.0.11 with an acl_file
    never sends one): permanent ones make every later wait raise with cause and fix, transient ones re-subscribe."""
    # Prepare
    broker = broker_with()
    site = MqttTransport(broker.settings("site-a"), client_id="site").connect(timeout_s=10)
    wanted = f"{topics.run_prefix(RUN)}/ps/model"
    site._filters.append(wanted)
    site._sub_mids[999] = [wanted]
    try:
        # Execute
        site._on_subscribe(site._client, None, 999, [ReasonCode(PacketTypes.SUBACK, identifier=code)], None)
        # Assert
        assert is_transient(code) is transient
        if transient:
            assert site.get(0.1) is None and site.connected  # keeps going; a re-subscribe is scheduled
        else:
            with pytest.raises(PermanentBrokerError, match=rf"subscription to {wanted} refused.*\(0x{code:02X}\)"):
                site.get(0.1)
    finally:
        site.close()


def test_every_code_has_a_cause_and_a_fix() -> None:
    """Every failure code of CONNACK/PUBACK/PUBREC/PUBCOMP/SUBACK/DISCONNECT explains itself."""
    for packet in (PacketTypes.CONNACK, PacketTypes.PUBACK, PacketTypes.PUBREC, PacketTypes.PUBCOMP,
                   PacketTypes.SUBACK, PacketTypes.DISCONNECT):
        for code in range(0x80, 0x100):
            try:
                reason = ReasonCode(packet, identifier=code)
            except (KeyError, ValueError):  # not a code of this packet
                continue
            text = explain("x", reason, user="u", broker="b:1")
            assert f"(0x{code:02X})" in text
            assert ("retrying" in text) is is_transient(code)
            assert "unexpected refusal" not in text, (packet, hex(code))
