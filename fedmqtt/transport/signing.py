"""Ed25519 signatures of one federation: sign what this party publishes, verify what the others did, and follow
the coordinator-signed key list as parties are added, removed and rotated.

Who holds what (docs/threat-model.md, "Keys"): the coordinator's private key lives only in the coordinating
team's own file (`broker init` writes it under <federation>/coordinator/) and signs nothing but the key list;
each party's private key lives only in its own credentials file (the `[signing]` table, 0600); every party,
observers included, holds the coordinator's public key (pinned there) and a key list signed with it. The wire
format (what is signed, how it travels) is in schemas/signed.py and schemas/envelope.py.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterable
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field

from fedmqtt.atomic import write_atomic
from fedmqtt.config_io import read_toml, validate_config
from fedmqtt.errors import ConfigError, SchemaError
from fedmqtt.transport.topics import federation_keys_topic
from schemas.base import ID_PATTERN
from schemas.codec import WireError, clip, decode, encode
from schemas.envelope import seal, unseal
from schemas.signed import COORDINATOR, PUBLIC_KEY_PATTERN, KeyList, PartyKey, Signature, key_id, signed_digest

log = logging.getLogger(__name__)

# Refusal categories (ChannelStats, ps/status `rejected`), next to the envelope's "unsigned".
BAD_SIGNATURE = "bad signature"  # the bytes are not what the named key signed: altered, or forged
UNKNOWN_KEY = "unknown key"  # the signer is not in the key list (removed), or its key there is another (rotated)
WRONG_SIGNER = "wrong signer"  # signed by a party other than the topic's owner
SIGNING_TABLE = "signing"
KEY_LIST_FILE = "key-list.json"  # the newest key list a party accepted, in its state or output folder


# -- keys -------------------------------------------------------------------------------------------------
def new_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_raw(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """The 32 raw bytes of a public key (of a private key's public half)."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def b64u(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def from_b64u(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def private_pem(key: Ed25519PrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode("ascii")


def load_private_pem(text: str, *, source: str) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(text.encode("ascii"), password=None)
    except (ValueError, TypeError, UnicodeEncodeError) as exc:
        raise ConfigError(f"{source}: the signing key is not a PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{source}: the signing key is a {type(key).__name__}, not an Ed25519 key")
    return key


def sign(key: Ed25519PrivateKey, signer: str, topic: str, body: bytes | bytearray | memoryview, *,
         kid: str | None = None) -> Signature:
    """`signer`'s signature of `body` published on `topic` (`kid`: the key's id, if the caller knows it)."""
    return Signature(signer=signer, key_id=kid or key_id(public_raw(key)), ed25519=key.sign(signed_digest(topic, body)))


def make_key_list(run_id: str, keys: dict[str, bytes], *, version: int) -> KeyList:
    """The key list of `run_id`: party -> raw public key."""
    return KeyList(run_id=run_id, sender=COORDINATOR, round=0, version=version,
                   keys={party: PartyKey(ed25519=b64u(raw)) for party, raw in sorted(keys.items())})


def seal_key_list(coordinator: Ed25519PrivateKey, key_list: KeyList) -> bytes:
    """The key list as it is published on `federation/keys` and written into credentials files."""
    topic = federation_keys_topic(key_list.run_id)
    body = encode(key_list)
    return seal(body, sign(coordinator, COORDINATOR, topic, body))


def list_keys(key_list: KeyList) -> dict[str, bytes]:
    """party -> raw public key of a checked key list."""
    return {party: from_b64u(entry.ed25519) for party, entry in key_list.keys.items()}


# -- verifying --------------------------------------------------------------------------------------------
class KeyRing:
    """The key list this party trusts now: the newest coordinator-signed one it has seen.

    Starts from the list in the party's credentials file (and, with `store`, the newest one it accepted before a
    restart, so that a replayed older list cannot bring back a removed party's key); `adopt` takes a newer one
    from `federation/keys`. A removed or rotated key is refused from the moment its list is taken.
    """

    def __init__(self, run_id: str, coordinator_key: bytes, key_list: bytes, *, store: Path | None = None,
                 own: tuple[str, bytes] | None = None) -> None:
        """`own`: this party's name and public key, to say so when a new list rotates or removes it."""
        self.run_id = run_id
        self._coordinator = Ed25519PublicKey.from_public_bytes(coordinator_key)
        self._coordinator_id = key_id(coordinator_key)
        self.store = store
        self.own = own
        try:
            first = self._check_sealed(key_list)
        except (SchemaError, ValueError) as exc:
            raise ConfigError(f"the key list in the credentials is not one the coordinator signed for run "
                              f"{run_id}: {exc}") from None
        self._take(first, key_list)
        if store is not None and store.is_file():
            try:
                stored = store.read_bytes()
                self.adopt(self._check_sealed(stored), stored, persist=False)
            except (SchemaError, ValueError, OSError) as exc:
                log.warning("ignored the key list stored in %s (%s): using version %d from the credentials", store,
                            clip(exc), self.version)

    @property
    def version(self) -> int:
        return self.current.version

    def _take(self, key_list: KeyList, sealed: bytes) -> None:
        self.current = key_list
        self.sealed = sealed
        self._keys = {party: (key_id(raw), Ed25519PublicKey.from_public_bytes(raw))
                      for party, raw in list_keys(key_list).items()}

    def _check_sealed(self, sealed: bytes) -> KeyList:
        topic = federation_keys_topic(self.run_id)
        signature, body = unseal(sealed, max_bytes=len(sealed))
        self.verify(topic, COORDINATOR, signature, body)
        message = decode(body, max_bytes=len(body))
        if not isinstance(message, KeyList) or message.run_id != self.run_id:
            raise SchemaError(f"not a key list of run {self.run_id}")
        return message

    def public_key(self, party: str) -> tuple[str, Ed25519PublicKey] | None:
        """(key id, key) of `party` in the current list; the pinned key for the coordinator."""
        if party == COORDINATOR:
            return self._coordinator_id, self._coordinator
        return self._keys.get(party)

    def open(self, topic: str, owner: str, payload: bytes | bytearray, *, max_bytes: int) -> bytes:
        """The body of `payload` if `owner` (the party that may write `topic`) signed it for `topic` with its
        current key; WireError otherwise. The body is not parsed."""
        signature, body = unseal(payload, max_bytes=max_bytes)
        self.verify(topic, owner, signature, body)
        return body

    def verify(self, topic: str, owner: str, signature: Signature, body: bytes | bytearray | memoryview) -> None:
        if signature.signer != owner:
            raise WireError(WRONG_SIGNER, f"{topic}: signed by {signature.signer!r}, but only {owner!r} may write "
                                          "this topic")
        known = self.public_key(owner)
        if known is None:
            raise WireError(UNKNOWN_KEY, f"{topic}: {owner!r} has no key in key list version {self.version} "
                                         "(removed from the federation?)")
        kid, key = known
        if kid != signature.key_id and owner == COORDINATOR:
            raise WireError(BAD_SIGNATURE, f"{topic}: signed with key {signature.key_id}, not with the coordinator "
                                           f"key pinned in the credentials ({kid})")
        if kid != signature.key_id:
            raise WireError(UNKNOWN_KEY, f"{topic}: signed with key {signature.key_id}, but {owner!r}'s key in key "
                                         f"list version {self.version} is {kid} (rotated?)")
        try:
            key.verify(signature.ed25519, signed_digest(topic, body))
        except InvalidSignature:
            raise WireError(BAD_SIGNATURE, f"{topic}: the signature of {owner!r} does not match the message "
                                           "(altered on the way, or forged)") from None

    def adopt(self, key_list: KeyList, sealed: bytes, *, persist: bool = True) -> bool:
        """Take `key_list` (already checked: signed by the coordinator, for this run) if it is newer than ours."""
        if key_list.run_id != self.run_id or key_list.version <= self.version:
            return False
        before = set(self._keys)
        old_ids = {party: kid for party, (kid, _) in self._keys.items()}
        self._take(key_list, sealed)
        changed = sorted(p for p in before & set(self._keys) if old_ids[p] != self._keys[p][0])
        log.info("key list version %d taken: added %s, removed %s, new keys for %s", self.version,
                    sorted(set(self._keys) - before) or "none", sorted(before - set(self._keys)) or "none",
                    changed or "none")
        self._say_if_own_key_gone()
        if persist and self.store is not None:
            self.store.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.store, sealed)
        return True

    def _say_if_own_key_gone(self) -> None:
        if self.own is None:
            return
        party, raw = self.own
        entry = self.public_key(party)
        if entry is None:
            log.error("this party (%s) is not in key list version %d: it was removed from the federation, and "
                      "every other party refuses what it sends", party, self.version)
        elif entry[0] != key_id(raw):
            log.error("this party's signing key (%s) was rotated in key list version %d: every other party refuses "
                      "what it sends until it restarts with its new credentials file", party, self.version)


class Identity:
    """What one party signs with (nothing, for an observer) and verifies against."""

    def __init__(self, party: str, ring: KeyRing, private_key: Ed25519PrivateKey | None = None) -> None:
        self.party = party
        self.ring = ring
        self.private_key = private_key
        self._kid = key_id(public_raw(private_key)) if private_key is not None else None

    def seal(self, topic: str, body: bytes) -> bytes:
        """`body` signed by this party for `topic`, as it goes on the wire."""
        if self.private_key is None:
            raise ConfigError(f"{self.party!r} holds no signing key: it may read, not publish")
        return seal(body, sign(self.private_key, self.party, topic, body, kid=self._kid))


# -- a party's [signing] table ------------------------------------------------------------------------------
class SigningSettings(BaseModel):
    """The `[signing]` table of a credentials file (written by `fedmqtt broker init`, `add-site`, `rotate`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    party: str = Field(pattern=ID_PATTERN, description="the party these credentials belong to: `ps`, `observer` "
                       "or a site id")
    private_key: str | None = Field(default=None, repr=False, description="this party's own Ed25519 signing key "
                                    "(PEM); never in anyone else's file. Observers have none")
    coordinator_key: str = Field(pattern=PUBLIC_KEY_PATTERN, description="the coordinator's public key (pinned): "
                                 "only key lists it signed are taken")
    key_list: str = Field(description="the coordinator-signed key list when this file was written; newer ones "
                          "arrive on `federation/keys`")


def load_identity(credentials: Path, *, run_id: str, store: Path | None = None) -> Identity:
    """The identity in a credentials file's `[signing]` table. `store`: where this party keeps the newest key list
    it accepted (its state or output folder), so a restart never falls back to an older one."""
    data = read_toml(credentials)
    if SIGNING_TABLE not in data:
        raise ConfigError(f"{credentials}: no [{SIGNING_TABLE}] table. These credentials were made before messages "
                          "were signed; ask the coordinator for a new file (`fedmqtt broker rotate --party <you>`, "
                          "or `fedmqtt broker init --force` for a federation made before signed messages)")
    settings = validate_config(data[SIGNING_TABLE], SigningSettings, source=str(credentials))
    key = None
    if settings.private_key is not None:
        key = load_private_pem(settings.private_key, source=str(credentials))
    own = (settings.party, public_raw(key)) if key is not None else None
    ring = KeyRing(run_id, from_b64u(settings.coordinator_key), settings.key_list.encode("utf-8"), store=store,
                   own=own)
    if own is not None:
        entry = ring.public_key(settings.party)
        if entry is None:
            raise ConfigError(f"{credentials}: {settings.party!r} is not in the federation's key list (version "
                              f"{ring.version}): removed? Ask the coordinator for a new credentials file")
        if entry[0] != key_id(own[1]):
            raise ConfigError(f"{credentials}: this signing key was replaced in key list version {ring.version} "
                              "(rotated): use the newest credentials file the coordinator handed over")
    return Identity(settings.party, ring, key)


# -- every key at once: a simulation (one process plays every party) and tests ------------------------------
class FederationKeys:
    """The coordinator's and every party's keys of one federation, in one process. A deployment never holds
    this (each party has its own Identity); `fedmqtt simulate` does, since it plays every party."""

    def __init__(self, run_id: str, parties: Iterable[str]) -> None:
        self.run_id = run_id
        self.coordinator = new_private_key()
        self.private = {party: new_private_key() for party in parties}
        self.version = 1

    def key_list(self) -> KeyList:
        return make_key_list(self.run_id, {p: public_raw(k) for p, k in self.private.items()}, version=self.version)

    def sealed_key_list(self) -> bytes:
        return seal_key_list(self.coordinator, self.key_list())

    def identity(self, party: str) -> Identity:
        """`party`'s identity (a party outside the list, e.g. "observer", verifies only)."""
        ring = KeyRing(self.run_id, public_raw(self.coordinator), self.sealed_key_list())
        return Identity(party, ring, self.private.get(party))
