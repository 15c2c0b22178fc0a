"""Signed messages (schemas/signed.py, schemas/envelope.py, fedmqtt/transport/signing.py): what a receiver takes,
and that any change to the topic, the payload or the signature is refused before the body is parsed."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedmqtt.config_io import dump_toml
from fedmqtt.errors import ConfigError
from fedmqtt.transport import topics
from fedmqtt.transport.channel import Channel
from fedmqtt.transport.memory import SIMULATION_SETTINGS, MemoryBroker, MemoryTransport
from fedmqtt.transport.mqtt import RawMessage
from fedmqtt.transport.signing import (
    FederationKeys,
    KeyRing,
    b64u,
    load_identity,
    private_pem,
    public_raw,
    seal_key_list,
)
from schemas import messages as m
from schemas.codec import WireError, encode
from schemas.envelope import seal, unseal
from schemas.signed import Signature, signed_digest

RUN = "sig-run"
MAX = 1 << 20
KEYS = FederationKeys(RUN, ["ps", "site-a", "site-b"])
RING = KEYS.identity("observer").ring
TOPICS = [topics.ps_status_topic(RUN), topics.ps_model_topic(RUN), topics.ps_task_topic(RUN, "site-a"),
          topics.site_update_topic(RUN, "site-a"), topics.site_status_topic(RUN, "site-b"),
          topics.site_report_topic(RUN, "site-b")]
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _owner(topic: str) -> str:
    return topics.parse_topic(topic).owner


def _status(sender: str = "site-a") -> m.SiteStatus:
    return m.SiteStatus(run_id=RUN, sender=sender, round=0, state="online", n_train=10)


# -- the envelope and the signature ------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [True, False], ids=["json", "msgpack"])
def test_a_signed_message_opens_to_its_own_bytes(text: bool) -> None:
    topic = topics.site_status_topic(RUN, "site-a") if text else topics.site_update_topic(RUN, "site-a")
    body = encode(_status()) if text else b"\x82\xa1a\x01\xa1b\xc4\x03xyz"
    payload = KEYS.identity("site-a").seal(topic, body)
    assert RING.open(topic, "site-a", payload, max_bytes=MAX) == body
    # the 64-byte signature plus a few dozen bytes of names: base64 text for JSON, bytes for msgpack
    assert len(payload) - len(body) <= (200 if text else 64 + 32)


def test_json_kinds_stay_json_with_one_more_member() -> None:
    """Observers with any MQTT client read the same document, plus `signature`."""
    import json

    topic = topics.site_status_topic(RUN, "site-a")
    doc = json.loads(KEYS.identity("site-a").seal(topic, encode(_status())))
    assert doc["kind"] == "site_status" and doc["n_train"] == 10
    assert set(doc["signature"]) == {"signer", "key_id", "ed25519"} and doc["signature"]["signer"] == "site-a"


@st.composite
def _signed_and_mutated(draw: st.DrawFn) -> tuple[str, bytes, str, bytes]:
    """A payload as its owner signs it for a topic, and a different (topic, payload): any byte changed, inserted
    or removed, the signature replaced, or the topic swapped."""
    topic = draw(st.sampled_from(TOPICS))
    text = draw(st.booleans())
    body = (b'{"x":' + draw(st.binary(min_size=1, max_size=200)).hex().encode() + b"}" if text
            else draw(st.binary(min_size=1, max_size=300)))
    payload = KEYS.identity(_owner(topic)).seal(topic, body)
    how = draw(st.sampled_from(["flip", "insert", "delete", "topic", "resign", "truncate"]))
    new_topic, new = topic, bytearray(payload)
    if how == "flip":
        i = draw(st.integers(0, len(new) - 1))
        new[i] ^= draw(st.integers(1, 255))
    elif how == "insert":
        new.insert(draw(st.integers(0, len(new))), draw(st.integers(0, 255)))
    elif how == "delete":
        del new[draw(st.integers(0, len(new) - 1))]
    elif how == "truncate":
        new = new[:draw(st.integers(0, len(new) - 1))]
    elif how == "topic":
        new_topic = draw(st.sampled_from([t for t in TOPICS if t != topic]))
    else:  # the same body and topic, signed by another party's valid key
        other = draw(st.sampled_from([p for p in ("ps", "site-a", "site-b") if p != _owner(topic)]))
        new = bytearray(KEYS.identity(other).seal(topic, body))
    return topic, payload, new_topic, bytes(new)


@PROPERTY
@given(_signed_and_mutated())
def test_any_change_to_topic_payload_or_signature_is_refused(case: tuple[str, bytes, str, bytes]) -> None:
    topic, payload, new_topic, new = case
    assert RING.open(topic, _owner(topic), payload, max_bytes=MAX)  # the original passes
    with pytest.raises(WireError) as info:
        RING.open(new_topic, _owner(new_topic), new, max_bytes=MAX)
    assert info.value.category in {"unsigned", "malformed", "too large", "bad signature", "unknown key",
                                   "wrong signer"}


@PROPERTY
@given(st.binary(max_size=400))
def test_arbitrary_bytes_are_refused_as_unsigned_or_malformed(data: bytes) -> None:
    with pytest.raises(WireError) as info:
        RING.open(topics.site_update_topic(RUN, "site-a"), "site-a", data, max_bytes=MAX)
    assert info.value.category in {"unsigned", "malformed", "too large"}


def test_a_signature_cannot_be_moved_to_another_topic() -> None:
    """site-a's own status, replayed on its update topic (which it may write), fails: the topic is signed too."""
    body = encode(_status())
    payload = KEYS.identity("site-a").seal(topics.site_status_topic(RUN, "site-a"), body)
    with pytest.raises(WireError, match="does not match") as info:
        RING.open(topics.site_update_topic(RUN, "site-a"), "site-a", payload, max_bytes=MAX)
    assert info.value.category == "bad signature"


def test_the_signed_digest_separates_topic_and_body() -> None:
    """Moving bytes between topic and body changes what is signed (the topic's length is part of it)."""
    assert signed_digest("a/b", b"c") != signed_digest("a/", b"bc")
    assert signed_digest("a/b", b"") != signed_digest("a", b"/b")


def test_a_non_canonical_base64_signature_is_malformed() -> None:
    topic = topics.site_status_topic(RUN, "site-a")
    payload = KEYS.identity("site-a").seal(topic, encode(_status()))
    sig = payload.rsplit(b'"ed25519":"', 1)[1][:86]
    raw = base64.urlsafe_b64decode(sig + b"==")
    last = sig[-1:]  # 64 bytes use 4 bits of the last character: another character with the same 2 high bits
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    twin = bytes([alphabet[alphabet.index(last) ^ 1]])
    forged = payload.replace(sig, sig[:-1] + twin)
    assert base64.urlsafe_b64decode(sig[:-1] + twin + b"==") == raw
    with pytest.raises(WireError) as info:
        RING.open(topic, "site-a", forged, max_bytes=MAX)
    assert info.value.category == "malformed"


# -- who may sign what -----------------------------------------------------------------------------------------
def test_only_the_topics_owner_may_sign_it() -> None:
    topic = topics.site_update_topic(RUN, "site-a")
    by_b = KEYS.identity("site-b").seal(topic, b"\x80")
    with pytest.raises(WireError) as info:
        RING.open(topic, "site-a", by_b, max_bytes=MAX)
    assert info.value.category == "wrong signer"
    # ...and claiming to be site-a with site-b's key fails the signature check
    sig = unseal(by_b, max_bytes=MAX)[0]
    claimed = seal(b"\x80", Signature(signer="site-a", key_id=RING.public_key("site-a")[0], ed25519=sig.ed25519))
    with pytest.raises(WireError) as info:
        RING.open(topic, "site-a", claimed, max_bytes=MAX)
    assert info.value.category == "bad signature"


def test_an_observer_cannot_sign() -> None:
    with pytest.raises(ConfigError, match="may read, not publish"):
        KEYS.identity("observer").seal(topics.ps_status_topic(RUN), b"{}")


# -- the key list -------------------------------------------------------------------------------------------------
def test_a_removed_partys_key_is_refused_from_the_moment_the_new_list_is_taken() -> None:
    keys = FederationKeys(RUN, ["ps", "site-a", "site-b"])
    ring = keys.identity("ps").ring
    topic = topics.site_update_topic(RUN, "site-b")
    payload = keys.identity("site-b").seal(topic, b"\x80")
    assert ring.open(topic, "site-b", payload, max_bytes=MAX) == b"\x80"
    removed = keys.private.pop("site-b")
    keys.version = 2
    assert ring.adopt(keys.key_list(), keys.sealed_key_list())
    with pytest.raises(WireError, match="no key in key list version 2") as info:
        ring.open(topic, "site-b", payload, max_bytes=MAX)
    assert info.value.category == "unknown key"
    assert removed is not None


def test_a_rotated_key_works_and_the_old_one_is_refused() -> None:
    keys = FederationKeys(RUN, ["ps", "site-a"])
    ring = keys.identity("ps").ring
    topic = topics.site_status_topic(RUN, "site-a")
    old = keys.identity("site-a")
    keys.private["site-a"] = FederationKeys(RUN, ["x"]).private["x"]  # a new key for site-a
    keys.version = 2
    ring.adopt(keys.key_list(), keys.sealed_key_list())
    new = keys.identity("site-a")
    body = encode(_status())
    assert ring.open(topic, "site-a", new.seal(topic, body), max_bytes=MAX) == body
    with pytest.raises(WireError, match="rotated") as info:
        ring.open(topic, "site-a", old.seal(topic, body), max_bytes=MAX)
    assert info.value.category == "unknown key"


def test_an_older_or_equal_list_changes_nothing_and_a_stored_list_survives_a_restart(tmp_path: Path) -> None:
    keys = FederationKeys(RUN, ["ps", "site-a", "site-b"])
    first = keys.sealed_key_list()
    store = tmp_path / "state" / "key-list.json"
    ring = KeyRing(RUN, public_raw(keys.coordinator), first, store=store)
    del keys.private["site-b"]
    keys.version = 2
    second_list, second = keys.key_list(), keys.sealed_key_list()
    assert ring.adopt(second_list, second) and store.read_bytes() == second
    old = KeyRing(RUN, public_raw(keys.coordinator), first)
    assert not ring.adopt(old.current, first) and ring.version == 2  # a replayed version 1
    assert not ring.adopt(second_list, second)
    # a restart with the credentials' version 1: the stored version 2 wins, site-b stays removed
    again = KeyRing(RUN, public_raw(keys.coordinator), first, store=store)
    assert again.version == 2 and again.public_key("site-b") is None


def test_a_list_not_signed_by_the_pinned_coordinator_is_refused() -> None:
    keys = FederationKeys(RUN, ["ps", "site-a"])
    impostor = FederationKeys(RUN, ["ps", "site-a"])
    impostor.version = 9
    with pytest.raises(ConfigError, match="not one the coordinator signed"):
        KeyRing(RUN, public_raw(keys.coordinator), impostor.sealed_key_list())
    # on the wire: refused by the channel, and the list in use stays
    ps = Channel(MemoryTransport(MemoryBroker(), SIMULATION_SETTINGS, client_id="ps"), run_id=RUN,
                 identity=keys.identity("ps"))
    keys_topic = topics.federation_keys_topic(RUN)
    assert ps.accept(RawMessage(keys_topic, impostor.sealed_key_list(), True)) is None
    assert ps.stats.rejected_by_site == {"coordinator": {"bad signature": 1}}
    # a party's own key cannot sign a key list either
    forged = keys.identity("ps").seal(keys_topic, encode(impostor.key_list()))
    assert ps.accept(RawMessage(keys_topic, forged, True)) is None
    assert ps.stats.rejected_by_site["coordinator"]["wrong signer"] == 1
    assert ps.identity.ring.version == 1


def test_a_channel_follows_the_key_list_topic() -> None:
    """A newer coordinator-signed list on federation/keys is taken by every channel at once."""
    keys = FederationKeys(RUN, ["ps", "site-a", "site-b"])
    broker = MemoryBroker()
    ps = Channel(MemoryTransport(broker, SIMULATION_SETTINGS, client_id="ps"), run_id=RUN,
                 identity=keys.identity("ps"))
    ps.connect()
    ps.transport.subscribe([topics.any_site_filter(RUN, "status")])
    status_b = topics.site_status_topic(RUN, "site-b")
    site_b = keys.identity("site-b")
    del keys.private["site-b"]
    keys.version = 2
    broker.deliver(topics.federation_keys_topic(RUN), keys.sealed_key_list(), retain=True)
    assert ps.receive(0) is None and ps.identity.ring.version == 2
    broker.deliver(status_b, site_b.seal(status_b, encode(_status("site-b"))), retain=True)
    assert ps.receive(0) is None
    assert ps.stats.rejected_by_site == {"site-b": {"unknown key": 1}}


def test_a_signed_will_is_taken_like_any_status() -> None:
    """Channel.open signs the Will once, at connect time; the broker may publish it any time later."""
    broker = MemoryBroker()
    wills: list[tuple[str, bytes]] = []

    def factory(**kw):  # noqa: ANN001, ANN202
        if kw.get("will") is not None:
            wills.append(kw["will"])
        return MemoryTransport(broker, SIMULATION_SETTINGS, **kw)

    topic = topics.site_status_topic(RUN, "site-a")
    offline = encode(m.SiteStatus(run_id=RUN, sender="site-a", round=0, state="offline"))
    Channel.open(factory, client_id="site-a", will=(topic, offline), run_id=RUN, identity=KEYS.identity("site-a"))
    assert len(wills) == 1 and wills[0][1] != offline
    ps = Channel(MemoryTransport(broker, SIMULATION_SETTINGS, client_id="ps"), run_id=RUN,
                 identity=KEYS.identity("ps"))
    inbound = ps.accept(RawMessage(*wills[0], True))  # as the broker would publish it
    assert inbound is not None and inbound.message.state == "offline"


@pytest.mark.parametrize(("payload", "category"), [
    (b'{"kind":"site_status"}', "unsigned"),
    (b"\x81\xa4kind\xa6update", "unsigned"),
    (b"\x94\xa6site-b\xc0", "malformed"),  # the envelope's array, cut short after its signer
], ids=["json", "msgpack", "broken-envelope"])
def test_unsigned_payloads_are_counted_for_the_topics_owner(payload: bytes, category: str) -> None:
    ps = Channel(MemoryTransport(MemoryBroker(), SIMULATION_SETTINGS, client_id="ps"), run_id=RUN,
                 identity=KEYS.identity("ps"))
    assert ps.accept(RawMessage(topics.site_update_topic(RUN, "site-b"), payload, True)) is None
    assert ps.stats.rejected_by_site == {"site-b": {category: 1}}


# -- a party's credentials ---------------------------------------------------------------------------------------
def _credentials(tmp_path: Path, keys: FederationKeys, party: str, **over: object) -> Path:
    signing: dict[str, object] = {"party": party, "coordinator_key": b64u(public_raw(keys.coordinator)),
                                  "key_list": keys.sealed_key_list().decode()}
    if party in keys.private:
        signing["private_key"] = private_pem(keys.private[party])
    signing.update(over)
    path = tmp_path / f"{party}.toml"
    path.write_text(dump_toml({"signing": signing, "broker": {"username": party, "password": "x"}}))
    return path


def test_credentials_without_a_signing_table_say_how_to_get_one(tmp_path: Path) -> None:
    path = tmp_path / "old.toml"
    path.write_text('[broker]\nusername = "site-a"\npassword = "x"\n')
    with pytest.raises(ConfigError, match="made before messages were signed.*broker rotate --party"):
        load_identity(path, run_id=RUN)


def test_credentials_whose_key_was_rotated_are_refused_at_start(tmp_path: Path) -> None:
    keys = FederationKeys(RUN, ["ps", "site-a"])
    path = _credentials(tmp_path, keys, "site-a")
    assert load_identity(path, run_id=RUN).party == "site-a"
    stale = _credentials(tmp_path, keys, "site-a", private_key=private_pem(FederationKeys(RUN, ["x"]).private["x"]))
    with pytest.raises(ConfigError, match="rotated"):
        load_identity(stale, run_id=RUN)


def test_a_key_list_of_another_run_is_refused(tmp_path: Path) -> None:
    keys = FederationKeys("other-run", ["ps", "site-a"])
    path = _credentials(tmp_path, keys, "site-a")
    with pytest.raises(ConfigError, match="not one the coordinator signed"):
        load_identity(path, run_id=RUN)
    assert seal_key_list(keys.coordinator, keys.key_list())  # the list itself is fine, for its own run
