"""The masks of one round, computed the same way by a site (to add them) and by the PS (to remove what is left).

y_i = x_i + PRG(b_i) + sum over paired neighbours j of sign(i, j) * PRG(s_ij)   (mod 2^bits)
sign(i, j) = +1 when i < j (site ids compared as strings), -1 otherwise, so each pair's masks cancel in the sum.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedmqtt.secagg.context import RoundContext
from fedmqtt.secagg.kdf import agree, pair_mask_key, self_mask_key
from fedmqtt.secagg.ring import RingVector
from fedmqtt.secagg.stream import expand


def self_mask(ctx: RoundContext, seed: bytes, site: str, length: int, dtype: type[np.unsignedinteger]) -> RingVector:
    return expand(self_mask_key(ctx, seed, site), length, dtype)


def pair_mask(ctx: RoundContext, own_key: X25519PrivateKey, own: str, other_public: bytes, other: str,
              length: int, dtype: type[np.unsignedinteger]) -> RingVector:
    """sign(own, other) * PRG(s_(own, other)): the term `own`'s masked input carries for the pair."""
    mask = expand(pair_mask_key(ctx, agree(own_key, other_public), own, other), length, dtype)
    return mask if own < other else (-mask).astype(dtype, copy=False)
