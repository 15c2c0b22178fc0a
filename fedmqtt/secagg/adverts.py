"""A site's signed key advertisement: making it and checking it.

The advertisement carries the round's two X25519 public keys and the commitment to the self-mask seed, signed
with the site's Ed25519 key of the federation's key list (`fedmqtt.transport.signing.sign`). The PS relays it to
the site's neighbours, and each of them checks the signature itself (a `Verifier`, such as the party's
`KeyRing`): neither the PS nor the broker can put a key of its own in a site's place.
"""

from __future__ import annotations

from typing import Protocol

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedmqtt.errors import SchemaError
from fedmqtt.secagg import messages as msg
from fedmqtt.secagg.context import RoundContext
from fedmqtt.secagg.kdf import agree
from fedmqtt.transport.signing import sign
from schemas.signed import Signature


class Verifier(Protocol):
    """Checks `owner`'s signature of `body` under `topic` (fedmqtt.transport.signing.KeyRing is one); raises
    SchemaError (WireError) when it does not hold."""

    def verify(self, topic: str, owner: str, signature: Signature, body: bytes | bytearray | memoryview) -> None:
        ...


def public_raw(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def make_advert(ctx: RoundContext, site: str, signing_key: Ed25519PrivateKey, cipher_public: bytes,
                mask_public: bytes, commitment: bytes) -> msg.KeyAdvert:
    body = msg.advert_body(ctx, site, cipher_public, mask_public, commitment)
    return msg.KeyAdvert(site, cipher_public, mask_public, commitment,
                         sign(signing_key, site, ctx.advert_label(), body))


def usable_public(raw: bytes) -> bool:
    """Whether an X25519 agreement with `raw` gives a shared secret. A low-order point gives all zeros with every
    (clamped) private key, so one trial with a fresh key tells; cryptography refuses that result."""
    try:
        agree(X25519PrivateKey.generate(), raw)
    except ValueError:
        return False
    return True


def check_advert(ctx: RoundContext, advert: msg.KeyAdvert, verifier: Verifier) -> tuple[str, str] | None:
    """(refusal category, reason) when `advert` is not a valid advertisement of its site for this round."""
    sizes = (len(advert.cipher_public), len(advert.mask_public), len(advert.seed_commitment))
    if sizes != (msg.PUBLIC_KEY_BYTES, msg.PUBLIC_KEY_BYTES, msg.COMMITMENT_BYTES):
        return msg.MALFORMED, f"key or commitment of the wrong size {sizes}"
    if advert.cipher_public == advert.mask_public:
        return msg.MALFORMED, "the same key for masks and for shares"
    try:
        verifier.verify(ctx.advert_label(), advert.site, advert.signature, advert.signed_body(ctx))
    except SchemaError as exc:
        return msg.BAD_SIGNATURE, str(exc)
    if not (usable_public(advert.cipher_public) and usable_public(advert.mask_public)):
        # signed, so its own site's doing: a key no neighbour could agree on would knock them out of the round
        return msg.MALFORMED, "a public key of low order (no shared secret can come of it)"
    return None
