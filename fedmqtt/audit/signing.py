"""The optional signature on each audit record: Ed25519 over the record's hash, by the writing party's key.

A hash chain alone shows that a log was changed, unless whoever changed it rewrote every hash after the
change; a signature by a key the writer holds (and the log's reader trusts) rules that out too. Writers take any
`Signer` (e.g. the party's signing key from its credentials); `verify` checks signatures against public keys.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedmqtt.audit.record import AuditRecord, Signature

# What is signed starts with this, so a key that also signs protocol messages never signs something that reads
# as another kind of message.
DOMAIN = b"fedmqtt audit record v1\n"


class Signer(Protocol):
    """Signs a record's hash: `key_id` names the key in the record, `sign` returns the raw signature."""

    @property
    def key_id(self) -> str: ...

    def sign(self, data: bytes) -> bytes: ...


def key_id_of(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


class Ed25519Signer:
    """A `Signer` holding an Ed25519 private key."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.key_id = key_id_of(private_key.public_key())

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)


def signed_bytes(record_hash: str) -> bytes:
    return DOMAIN + record_hash.encode("ascii")


def signature_for(record_hash: str, signer: Signer) -> Signature:
    raw = signer.sign(signed_bytes(record_hash))
    return Signature(key=signer.key_id, ed25519=base64.b64encode(raw).decode("ascii"))


def load_public_keys(paths: Iterable[Path]) -> dict[str, Ed25519PublicKey]:
    """Key id -> key, from PEM files (SubjectPublicKeyInfo, as `openssl pkey -pubout` writes)."""
    keys = {}
    for path in paths:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError(f"{path}: not an Ed25519 public key")
        keys[key_id_of(key)] = key
    return keys


def signature_problem(record: AuditRecord, keys: dict[str, Ed25519PublicKey]) -> str | None:
    """Why `record` is not signed by one of `keys`; None when it is."""
    if record.sig is None:
        return "it is not signed"
    key = keys.get(record.sig.key)
    if key is None:
        return f"it is signed by key {record.sig.key}, which is not among the keys given"
    try:
        key.verify(base64.b64decode(record.sig.ed25519), signed_bytes(record.hash))
    except InvalidSignature:
        return f"its signature by key {record.sig.key} does not verify"
    return None
