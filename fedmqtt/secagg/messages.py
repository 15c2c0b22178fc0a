"""What the parties of one secure aggregation round hand each other, as plain frozen records (no I/O).

The wire forms (typed, signed message kinds in schemas/) carry exactly these fields. Which signature covers what:
- `KeyAdvert` is signed inside (Ed25519, the site's key of the federation's key list), because the PS relays it
  to the other sites: they verify the site's own signature, so neither the PS nor the broker can substitute keys;
- `ShareBundle`'s ciphertexts are AEAD-sealed with keys only the two sites can derive, and bound to sender,
  receiver, run and round; the PS routes them without being able to read or alter them;
- `MaskedInput`, `UnmaskRequest` and `UnmaskAnswer` go straight from their author to their reader, on a topic
  only the author may write, inside the transport's signed envelope (fedmqtt/transport/signing.py); the records
  here name their sender and the receiver checks it against the envelope's signer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedmqtt.secagg.context import RoundContext
from fedmqtt.secagg.ring import RingVector
from schemas.signed import Signature

PUBLIC_KEY_BYTES = 32
COMMITMENT_BYTES = 32


@dataclass(frozen=True)
class KeyAdvert:
    """Round 0: a site's two X25519 public keys (share encryption c, masks s) and its seed commitment, signed."""

    site: str
    cipher_public: bytes
    mask_public: bytes
    seed_commitment: bytes
    signature: Signature

    def signed_body(self, ctx: RoundContext) -> bytes:
        return advert_body(ctx, self.site, self.cipher_public, self.mask_public, self.seed_commitment)


def advert_body(ctx: RoundContext, site: str, cipher_public: bytes, mask_public: bytes, commitment: bytes) -> bytes:
    """What an advertisement's signature covers: the round context, the site and the three values."""
    return ctx.bind("advert", site, cipher_public, mask_public, commitment)


@dataclass(frozen=True)
class Roster:
    """Round 1, PS to one site: every site that advertised keys (the graph is built from these ids) and the signed
    advertisements of that site's neighbours and its own. Only those: a site never needs the others' keys, so what
    it receives and checks grows with its neighbourhood, not with the federation."""

    sites: tuple[str, ...]
    adverts: tuple[KeyAdvert, ...]


@dataclass(frozen=True)
class EncryptedShare:
    """One site's shares of its own two secrets, for one neighbour, sealed with ChaCha20-Poly1305."""

    sender: str
    receiver: str
    ciphertext: bytes


@dataclass(frozen=True)
class ShareBundle:
    """Round 1: one sealed share for each of the sender's neighbours."""

    sender: str
    shares: tuple[EncryptedShare, ...]


@dataclass(frozen=True)
class MaskedInput:
    """Round 2: the masked, encoded update, and the neighbours whose pairwise masks it carries (those from which the
    site received a share that opened; a neighbour left out is one it accuses of a missing or bad share)."""

    sender: str
    masked: RingVector
    paired_with: tuple[str, ...]


@dataclass(frozen=True)
class UnmaskRequest:
    """Round 3, PS to every survivor: whose self-mask shares (survivors) and whose mask-key shares (dropped) to
    reveal. The two sets are disjoint; each site answers for its own neighbours only."""

    survivors: tuple[str, ...]
    dropped: tuple[str, ...]


@dataclass(frozen=True)
class UnmaskAnswer:
    """Round 3, survivor to PS: owner -> (x-coordinate, share) of seeds (survivors) and of mask keys (dropped)."""

    sender: str
    seed_shares: dict[str, tuple[int, bytes]]
    mask_key_shares: dict[str, tuple[int, bytes]]


# Refusal categories: short and stable, for counters (as the transport's refusal categories are).
MALFORMED = "malformed"  # wrong length, dtype, ids, missing or extra entries
BAD_SIGNATURE = "bad signature"  # an advertisement its site did not sign for this round
UNKNOWN_PARTY = "unknown party"  # not selected, not in the roster, or no longer in the round
WRONG_STAGE = "wrong stage"  # too late (or too early) for this step
REPLAY = "replay"  # the same message again: ignored
EQUIVOCATION = "equivocation"  # a second, different message for the same step: the party is out of the round
BAD_SHARE = "bad share"  # a sealed share that does not open, or opens to the wrong index
ACCUSED = "accused"  # a neighbour reported a missing or bad share from this site
INCONSISTENT_SHARE = "inconsistent share"  # a share off the polynomial the other shares agree on
REFUSED_REQUEST = "refused request"  # an unmasking request an honest site must not answer


@dataclass(frozen=True)
class Refusal:
    """An input one party refused: who sent it, a short stable category and the full reason."""

    party: str
    category: str
    reason: str


@dataclass(frozen=True)
class RoundSum:
    """A completed round: the decoded sum and who is in it."""

    total: np.ndarray  # float64, the sum over `included` of the clipped updates (within the encoding's bound)
    included: tuple[str, ...]
    dropped_recovered: tuple[str, ...]  # sites whose pairwise masks were removed with their rebuilt mask key
    refusals: tuple[Refusal, ...]


@dataclass(frozen=True)
class RoundFailed:
    """A round that cannot complete safely; nothing of it may be aggregated."""

    reason: str
    refusals: tuple[Refusal, ...]
