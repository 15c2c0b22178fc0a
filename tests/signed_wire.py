"""Signing for tests that play several parties in one process (every key from one `FederationKeys`), so a test of
what comes after the signature check can send what a party holding its own valid key would send."""

from __future__ import annotations

from functools import cache

from fedmqtt.errors import TopicError
from fedmqtt.transport.signing import FederationKeys, Identity, KeyRing
from fedmqtt.transport.topics import parse_topic

PARTIES = ("ps", "site-a", "site-b", "site-c")


@cache
def keys(run_id: str) -> FederationKeys:
    """One federation's keys per run id, for the whole test session."""
    return FederationKeys(run_id, PARTIES)


def identity(run_id: str, party: str) -> Identity:
    return keys(run_id).identity(party)


def ring(run_id: str) -> KeyRing:
    """What a receiver verifies with (an observer's ring: every party's key, no key of its own)."""
    return keys(run_id).identity("observer").ring


def owner(topic: str) -> str:
    """The party that may write `topic` (for a topic that does not parse: the site named at its 5th level)."""
    try:
        return parse_topic(topic).owner
    except TopicError:
        parts = topic.split("/")
        return parts[4] if len(parts) > 4 and parts[3] == "site" else "ps"


def signed(run_id: str, topic: str, body: bytes, *, signer: str | None = None) -> bytes:
    """`body` as `signer` (default: the topic's owner) publishes it on `topic`."""
    party = signer or owner(topic)
    return keys(run_id).identity(party).seal(topic, body)
