"""Keys of one round from X25519 agreements and seeds: HKDF-SHA256 (RFC 5869) with the round context as `info`.

- the pairwise mask key of sites i and j: from X25519(s_i, S_j), bound to the sorted pair, so both derive it;
- the share-encryption key from i to j: from X25519(c_i, C_j), bound to the ordered pair (one key a direction,
  each used for a single message, so the AEAD nonce can be zero);
- the X25519 mask private key s_i of site i: from its 16-byte mask seed (what its neighbours hold shares of, so
  that the PS can rebuild the key of a site that dropped);
- the self-mask key of site i: from its 16-byte seed b_i;
- the commitment to b_i that its signed advertisement carries: SHA-256 of the context and the seed, so the PS can
  tell a correctly reconstructed seed from one rebuilt out of bad shares.
"""

from __future__ import annotations

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedmqtt.secagg.context import RoundContext

KEY_BYTES = 32
PAIR_MASK = "pair-mask"
SHARE_KEY = "share-key"
SELF_MASK = "self-mask"
MASK_KEY = "mask-key"
SEED_COMMITMENT = "seed-commitment"


def hkdf(secret: bytes, info: bytes, length: int = KEY_BYTES) -> bytes:
    """HKDF-SHA256 with no salt (RFC 5869: a string of zeros) and `info`."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(secret)


def agree(private: X25519PrivateKey, public: bytes) -> bytes:
    """The X25519 shared secret (cryptography refuses an all-zero result from a small-order point)."""
    return private.exchange(X25519PublicKey.from_public_bytes(public))


def pair_mask_key(ctx: RoundContext, shared: bytes, site_a: str, site_b: str) -> bytes:
    low, high = sorted((site_a, site_b))
    return hkdf(shared, ctx.bind(PAIR_MASK, low, high))


def share_key(ctx: RoundContext, shared: bytes, sender: str, receiver: str) -> bytes:
    return hkdf(shared, ctx.bind(SHARE_KEY, sender, receiver))


def mask_private_key(ctx: RoundContext, mask_seed: bytes, site: str) -> X25519PrivateKey:
    """Site `site`'s X25519 mask key of this round, from its mask seed (X25519 clamps any 32 bytes into a key)."""
    return X25519PrivateKey.from_private_bytes(hkdf(mask_seed, ctx.bind(MASK_KEY, site)))


def self_mask_key(ctx: RoundContext, seed: bytes, site: str) -> bytes:
    return hkdf(seed, ctx.bind(SELF_MASK, site))


def seed_commitment(ctx: RoundContext, seed: bytes, site: str) -> bytes:
    digest = hashes.Hash(hashes.SHA256())
    digest.update(ctx.bind(SEED_COMMITMENT, site))
    digest.update(seed)
    return digest.finalize()
