"""One message of each secure-aggregation kind (schemas/secagg.py), well formed as legitimate traffic sends it, for
the tests that need an example of every kind of `schemas.messages.Message` (codec round trips, hostile-wire fuzzing).
The bytes are fixed, not real keys: these tests check the schemas and the codec, not the cryptography (the round
tests do: tests/unit/test_secagg_protocol.py, tests/unit/test_secagg_wire.py)."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from schemas import secagg as wire
from schemas.signed import Signature
from schemas.tensors import TensorBlob


def _advert(site: str, fill: int) -> wire.KeyAdvertBody:
    return wire.KeyAdvertBody(site=site, cipher_public=bytes([fill]) * 32, mask_public=bytes([fill + 1]) * 32,
                              seed_commitment=bytes([fill + 2]) * 32,
                              signature=Signature(signer=site, key_id="0123456789abcdef", ed25519=bytes([fill]) * 64))


def secagg_examples(run_id: str, site: str = "site-a", other: str = "site-b") -> list[BaseModel]:
    """The seven kinds of one round between `site` and `other` (sorted ids: `site` < `other`)."""
    sealed = bytes(range(wire.SEALED_SHARE_BYTES))
    share = wire.ShareAnswer(owner=other, index=2, share=bytes(range(16)))
    masked = np.arange(-3, 5, dtype=np.int32)
    return [
        wire.SecAggAdvert(run_id=run_id, sender=site, round=3, advert=_advert(site, 1)),
        wire.SecAggRoster(run_id=run_id, sender="ps", round=3, site_id=site, sites=(site, other),
                          adverts=(_advert(site, 1), _advert(other, 7))),
        wire.SecAggShares(run_id=run_id, sender=site, round=3,
                          shares=(wire.SealedShare(peer=other, sealed=sealed),)),
        wire.SecAggInbox(run_id=run_id, sender="ps", round=3, site_id=site,
                         shares=(wire.SealedShare(peer=other, sealed=sealed),)),
        wire.SecAggMasked(run_id=run_id, sender=site, round=3, ring_bits=32, fraction_bits=16, clip=8.0,
                          masked=TensorBlob.from_numpy("masked", masked), paired_with=(other,)),
        wire.SecAggUnmask(run_id=run_id, sender="ps", round=3, site_id=site, survivors=(site,), dropped=(other,)),
        wire.SecAggAnswer(run_id=run_id, sender=site, round=3, seed_shares=(), mask_key_shares=(share,)),
    ]
