"""A site's shares for one neighbour, sealed with ChaCha20-Poly1305 (RFC 8439) so only that neighbour reads them.

The key comes from the two sites' share-encryption X25519 agreement through HKDF bound to (run, round, sender,
receiver); the associated data binds the same four, so a sealed share cannot be replayed into another round, run
or pair, nor its sender or receiver changed, without the tag failing. Each key seals one message, so the nonce is
zero. The plaintext: the holder's x-coordinate (2 bytes), its share of the sender's mask-key seed, its share of
the sender's self-mask seed (16 bytes each).
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from fedmqtt.secagg.context import RoundContext
from fedmqtt.secagg.shamir import SHARE_BYTES

NONCE = bytes(12)
TAG_BYTES = 16
INDEX_BYTES = 2
PLAINTEXT_BYTES = INDEX_BYTES + 2 * SHARE_BYTES
SEALED_BYTES = PLAINTEXT_BYTES + TAG_BYTES
SHARE_AD = "share"


@dataclass(frozen=True)
class HeldShares:
    """What a neighbour keeps of one site's secrets."""

    index: int
    mask_key_share: bytes
    seed_share: bytes


def aead_encrypt(key: bytes, plaintext: bytes, associated: bytes, *, nonce: bytes = NONCE) -> bytes:
    """ChaCha20-Poly1305: the ciphertext with its 16-byte tag appended."""
    return ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def aead_decrypt(key: bytes, sealed: bytes, associated: bytes, *, nonce: bytes = NONCE) -> bytes | None:
    """The plaintext, or None when the tag does not match (altered, or another key, nonce or associated data)."""
    try:
        return ChaCha20Poly1305(key).decrypt(nonce, sealed, associated)
    except InvalidTag:
        return None


def seal(ctx: RoundContext, key: bytes, sender: str, receiver: str, held: HeldShares) -> bytes:
    plaintext = held.index.to_bytes(INDEX_BYTES, "big") + held.mask_key_share + held.seed_share
    if len(plaintext) != PLAINTEXT_BYTES:
        raise ValueError(f"a share is {SHARE_BYTES} bytes")
    return aead_encrypt(key, plaintext, ctx.bind(SHARE_AD, sender, receiver))


def open_sealed(ctx: RoundContext, key: bytes, sender: str, receiver: str, ciphertext: bytes) -> HeldShares | None:
    """The shares inside, or None when the ciphertext is not one `sender` sealed for `receiver` this round."""
    if len(ciphertext) != SEALED_BYTES:
        return None
    plain = aead_decrypt(key, ciphertext, ctx.bind(SHARE_AD, sender, receiver))
    if plain is None:
        return None
    return HeldShares(int.from_bytes(plain[:INDEX_BYTES], "big"), plain[INDEX_BYTES:INDEX_BYTES + SHARE_BYTES],
                      plain[INDEX_BYTES + SHARE_BYTES:])
