"""Signed messages: what a signature covers, how it travels, and the federation's key list.

Every payload a party publishes (except a chunk, covered by its signed manifest) carries an Ed25519 signature
of its sender (docs/protocol.md, "Signatures"). What is signed is `signed_digest(topic, body)`: the SHA-512 of
a domain tag, the topic and the body, so a message cannot be replayed on another topic, and a large body is
hashed once (Ed25519 over the body itself would hash it twice when signing). How the signature travels
(schemas/envelope.py):

- observer kinds (JSON text) get one more member at the end, `"signature": {...}`: any JSON reader still sees
  the same document, with one extra key;
- every other kind is wrapped in a two-entry msgpack map, `{"signature": {...}, "body": <bin>}`.

The key list (`federation/keys`, retained) names every party's public key and is signed by the coordinator,
whose public key each party has pinned in its own credentials file.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

from pydantic import Field

from schemas.base import ID_PATTERN, MAX_COUNT, MAX_SITES, Frozen, Header

DOMAIN = b"fedmqtt signed message v1\x00"  # never a prefix of anything else we hash
SIGNATURE_BYTES = 64
KEY_ID_PATTERN = r"^[0-9a-f]{16}$"
PUBLIC_KEY_PATTERN = r"^[A-Za-z0-9_-]{43}$"  # 32 bytes, base64url without padding
COORDINATOR = "coordinator"  # the key list's signer; never a site id (broker/federation.py reserves it)
MAX_TOPIC_BYTES = 1024  # far above our longest topic; what the digest's 2-byte length prefix must hold

PartyName = Annotated[str, Field(pattern=ID_PATTERN)]


class Signature(Frozen):
    """Who signed (a party of the key list), with which of its keys, and the Ed25519 signature itself."""

    signer: str = Field(pattern=ID_PATTERN, description="the signing party: `ps`, a site id or `coordinator`")
    key_id: str = Field(pattern=KEY_ID_PATTERN, description="the first 8 bytes of the SHA-256 of the signer's "
                        "public key, in hex: names a rotated-out key in a refusal")
    ed25519: bytes = Field(min_length=SIGNATURE_BYTES, max_length=SIGNATURE_BYTES, strict=True,
                           description="Ed25519 signature of signed_digest(topic, body)")


class SignedEnvelope(Frozen):
    """A msgpack kind as it travels: the signature first, then the message's own encoding, unchanged. On the wire it
    is the msgpack array [signer, key id as 8 bytes, signature, body] (schemas/envelope.py)."""

    signature: Signature
    body: bytes = Field(min_length=1, strict=True)


class PartyKey(Frozen):
    """One party's public signing key."""

    ed25519: str = Field(pattern=PUBLIC_KEY_PATTERN, description="Ed25519 public key, base64url, no padding")


class KeyList(Header):
    """`federation/keys` (retained): every party's signing key, signed by the coordinator. JSON on the wire.

    `version` grows with every change (add-site, remove-site, rotate); a party takes a list only if it is newer
    than the one it holds, so a replayed older list changes nothing."""

    kind: Literal["key_list"] = "key_list"
    version: int = Field(ge=1, le=MAX_COUNT)
    keys: Annotated[dict[PartyName, PartyKey], Field(min_length=1, max_length=MAX_SITES + 2)]


def key_id(public_key: bytes) -> str:
    """The short name of a raw 32-byte public key in signatures and logs."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def signed_digest(topic: str, body: bytes | bytearray | memoryview) -> bytes:
    """What the signature signs: SHA-512(DOMAIN, topic length, topic, body), one pass over the body."""
    name = topic.encode("utf-8")
    if len(name) > MAX_TOPIC_BYTES:
        raise ValueError(f"topic of {len(name)} bytes is too long to sign")
    digest = hashlib.sha512(DOMAIN)
    digest.update(len(name).to_bytes(2, "big"))
    digest.update(name)
    digest.update(body)
    return digest.digest()
