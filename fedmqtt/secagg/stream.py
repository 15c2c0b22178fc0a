"""Ring vectors from a 32-byte key: the ChaCha20 keystream (RFC 8439), read as little-endian ring elements.

Every mask of secure aggregation comes from here. The key is used once (each key is derived for one purpose, one
pair of sites, one round of one run), so the nonce and counter start at zero. The ring is Z_(2^bits) and the
keystream is uniform over bytes, so every element is exactly uniform: no modulo bias, no seed folded into a
statistical generator.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedmqtt.secagg.ring import RingVector

KEY_BYTES = 32
ZERO_NONCE = bytes(16)  # cryptography's ChaCha20 nonce: 4-byte little-endian block counter, then the 12-byte nonce


def keystream(key: bytes, length: int, *, nonce: bytes = ZERO_NONCE) -> bytes:
    """`length` bytes of the ChaCha20 keystream of `key` (the encryption of zeros)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a ChaCha20 key has {KEY_BYTES} bytes, not {len(key)}")
    encryptor = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()
    return encryptor.update(bytes(length)) + encryptor.finalize()


def expand(key: bytes, length: int, dtype: type[np.unsignedinteger]) -> RingVector:
    """`length` uniform elements of the ring whose dtype is `dtype` (uint32 or uint64), from `key`."""
    width = np.dtype(dtype).itemsize
    raw = keystream(key, length * width)
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype, copy=False)
