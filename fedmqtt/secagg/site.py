"""One site's side of a secure aggregation round, as a state object with one method a step (no I/O).

advertise -> share (given the roster the PS relays) -> mask (given the sealed shares addressed to it and its
update) -> unmask (given the PS's request). Each step validates everything it is handed and raises
`SecAggRefused` (the site leaves the round) when the PS's input is not one an honest PS could send; a neighbour's
bad share only takes that neighbour out of this site's masks (the masked input says so, and the PS drops it).
The site never reveals both secrets of one neighbour, and answers one unmasking request only (the same request
again gets the same answer, for a PS that resumed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedmqtt.errors import ConfigError, FedMqttError
from fedmqtt.secagg import messages as msg
from fedmqtt.secagg import shamir
from fedmqtt.secagg.adverts import Verifier, check_advert, make_advert, public_raw
from fedmqtt.secagg.context import RoundContext
from fedmqtt.secagg.graph import Graph, build
from fedmqtt.secagg.kdf import agree, mask_private_key, seed_commitment, share_key
from fedmqtt.secagg.masks import pair_mask, self_mask
from fedmqtt.secagg.ring import FixedPoint
from fedmqtt.secagg.sealing import HeldShares, open_sealed, seal

SEED_BYTES = shamir.SECRET_BYTES  # both seeds: 128 bits, X25519's security level
SECRETS_BYTES = 32 + 2 * SEED_BYTES


class SecAggRefused(FedMqttError):
    """This party will not go on with the round; `category` is one of fedmqtt.secagg.messages' categories."""

    def __init__(self, category: str, reason: str) -> None:
        super().__init__(reason)
        self.category = category


@dataclass(frozen=True)
class SiteSecrets:
    """The three secrets of one site's round: its share-encryption private key, its mask seed and its self-mask
    seed. Everything else a site holds follows from them and the messages it received, so they are what it keeps
    on disk (site_agent/secagg_store.py) to answer after a restart."""

    cipher_private: bytes  # X25519 private key, raw
    mask_seed: bytes
    seed: bytes

    @classmethod
    def fresh(cls) -> SiteSecrets:
        return cls(X25519PrivateKey.generate().private_bytes_raw(), os.urandom(SEED_BYTES), os.urandom(SEED_BYTES))

    def to_bytes(self) -> bytes:
        return self.cipher_private + self.mask_seed + self.seed

    @classmethod
    def from_bytes(cls, raw: bytes) -> SiteSecrets:
        if len(raw) != SECRETS_BYTES:
            raise ValueError(f"round secrets are {SECRETS_BYTES} bytes, not {len(raw)}")
        return cls(raw[:32], raw[32:32 + SEED_BYTES], raw[32 + SEED_BYTES:])


class SiteSession:
    """A site's secrets and progress in one round."""

    def __init__(self, ctx: RoundContext, site: str, signing_key: Ed25519PrivateKey, verifier: Verifier,
                 fixed: FixedPoint, length: int, *, dropout: float, secrets: SiteSecrets | None = None) -> None:
        """`secrets`: the ones this site kept for the round (after a restart); default: fresh ones."""
        self.ctx, self.site, self.verifier, self.fixed, self.length, self.dropout = (
            ctx, site, verifier, fixed, length, dropout)
        self.secrets = secrets or SiteSecrets.fresh()
        self._cipher_key = X25519PrivateKey.from_private_bytes(self.secrets.cipher_private)
        self._mask_seed = self.secrets.mask_seed
        self._mask_key = mask_private_key(ctx, self._mask_seed, site)
        self._seed = self.secrets.seed
        self.advert = make_advert(ctx, site, signing_key, public_raw(self._cipher_key), public_raw(self._mask_key),
                                  seed_commitment(ctx, self._seed, site))
        self.stage = "advertised"
        self.graph: Graph | None = None
        self.roster: dict[str, msg.KeyAdvert] = {}  # this site's and its neighbours' advertisements
        self.sites: frozenset[str] = frozenset()  # every site of the round's roster
        self.held: dict[str, HeldShares] = {}
        self.refusals: list[msg.Refusal] = []
        self._answered: tuple[msg.UnmaskRequest, msg.UnmaskAnswer] | None = None

    def advertise(self) -> msg.KeyAdvert:
        return self.advert

    # -- round 1 ------------------------------------------------------------------------------------------
    def share(self, roster: msg.Roster) -> msg.ShareBundle:
        """Seal shares of this site's mask key and seed for each of its neighbours in the roster's graph."""
        self._expect("advertised")
        graph = self._accept_roster(roster)
        neighbours = graph.neighbours[self.site]
        t = graph.params.threshold
        key_shares = shamir.split(self._mask_seed, t, len(neighbours))
        seed_shares = shamir.split(self._seed, t, len(neighbours))
        sealed = []
        for position, neighbour in enumerate(neighbours):
            try:
                key = share_key(self.ctx, agree(self._cipher_key, self.roster[neighbour].cipher_public), self.site,
                                neighbour)
            except ValueError as exc:  # a small-order public key: no shared secret
                raise SecAggRefused(msg.MALFORMED, f"{neighbour!r}'s share key: {exc}") from None
            held = HeldShares(position + 1, key_shares[position], seed_shares[position])
            sealed.append(msg.EncryptedShare(self.site, neighbour, seal(self.ctx, key, self.site, neighbour, held)))
        self.stage = "shared"
        return msg.ShareBundle(self.site, tuple(sealed))

    def resume(self, roster: msg.Roster, inbox: Sequence[msg.EncryptedShare] | None = None,
               answered: msg.UnmaskRequest | None = None) -> None:
        """Back where this site was before a restart, from its kept secrets and what it had received: the roster
        (its shares went out; they are not made again), the inbox (it sent its masked input: the shares it holds
        are opened again) and the unmasking request it answered (the same request gets the same answer, a
        different one is refused). Checks everything again, as the first time."""
        self._expect("advertised")
        self._accept_roster(roster)
        self.stage = "shared"
        if inbox is None:
            return
        self._take_inbox(inbox)
        self.stage = "masked"
        if answered is not None:
            self.unmask(answered)

    def _accept_roster(self, roster: msg.Roster) -> Graph:
        if list(roster.sites) != sorted(set(roster.sites)) or self.site not in roster.sites:
            raise SecAggRefused(msg.MALFORMED, "the roster's sites must be sorted, distinct and include this site")
        adverts = {a.site: a for a in roster.adverts}
        if len(adverts) != len(roster.adverts):
            raise SecAggRefused(msg.MALFORMED, "the roster carries two advertisements of one site")
        if adverts.get(self.site) != self.advert:
            raise SecAggRefused(msg.MALFORMED, "the roster does not carry this site's own advertisement")
        try:
            graph = build(self.ctx, roster.sites, self.dropout)
        except ConfigError as exc:
            raise SecAggRefused(msg.MALFORMED, str(exc)) from None
        if set(adverts) != {self.site, *graph.neighbours[self.site]}:
            raise SecAggRefused(msg.MALFORMED, "the roster's advertisements are not exactly this site's neighbours'")
        for advert in roster.adverts:
            problem = check_advert(self.ctx, advert, self.verifier)
            if problem is not None:
                raise SecAggRefused(problem[0], f"the roster's advertisement of {advert.site!r}: {problem[1]}")
        self.graph, self.roster, self.sites = graph, adverts, frozenset(roster.sites)
        return graph

    # -- round 2 ------------------------------------------------------------------------------------------
    def mask(self, update: npt.NDArray[np.floating], inbox: Sequence[msg.EncryptedShare],
             noise: npt.NDArray[np.int64] | None = None) -> msg.MaskedInput:
        """The masked encoding of `update`, paired with every neighbour whose sealed share opened. `noise`
        (distributed DP, fedmqtt/secagg/skellam.py) is added in the ring after encoding, never clipped, so that
        the sum is exactly the sum of the encodings plus the sum of the noises."""
        self._expect("shared")
        values = np.asarray(update)
        if values.shape != (self.length,):
            raise SecAggRefused(msg.MALFORMED, f"the update has shape {values.shape}, not ({self.length},)")
        paired = self._take_inbox(inbox)
        dtype = self.fixed.dtype
        try:
            total = self.fixed.encode(values)
        except ValueError as exc:
            raise SecAggRefused(msg.MALFORMED, str(exc)) from None
        if noise is not None:
            if noise.shape != (self.length,):
                raise SecAggRefused(msg.MALFORMED, f"the noise has shape {noise.shape}, not ({self.length},)")
            total = total + np.asarray(noise, dtype=np.int64).astype(dtype)  # two's complement: modular
        total = total + self_mask(self.ctx, self._seed, self.site, self.length, dtype)
        for neighbour in paired:
            total = total + pair_mask(self.ctx, self._mask_key, self.site, self.roster[neighbour].mask_public,
                                      neighbour, self.length, dtype)
        self.stage = "masked"
        return msg.MaskedInput(self.site, total.astype(dtype, copy=False), paired)

    def _take_inbox(self, inbox: Sequence[msg.EncryptedShare]) -> tuple[str, ...]:
        """Open the shares addressed to this site; the neighbours it holds shares of (it pairs with those)."""
        graph = self._graph()
        by_sender: dict[str, list[msg.EncryptedShare]] = {}
        for item in inbox:
            if item.receiver != self.site or not graph.are_neighbours(self.site, item.sender):
                self._refuse(item.sender, msg.UNKNOWN_PARTY, "a share from a non-neighbour or for another site")
            elif any(item.ciphertext == seen.ciphertext for seen in by_sender.setdefault(item.sender, [])):
                self._refuse(item.sender, msg.REPLAY, "the same sealed share again (ignored)")
            else:
                by_sender[item.sender].append(item)
        for sender, items in sorted(by_sender.items()):
            if len(items) > 1:  # two different shares: trust neither
                self._refuse(sender, msg.EQUIVOCATION, "two different sealed shares")
            else:
                self._take_share(graph, items[0])
        paired = tuple(sorted(self.held))
        if len(paired) < graph.params.threshold:
            raise SecAggRefused(msg.MALFORMED, f"only {len(paired)} neighbours' shares arrived, "
                                f"{graph.params.threshold} needed: too few to hide this update among")
        return paired

    def _take_share(self, graph: Graph, item: msg.EncryptedShare) -> None:
        try:
            key = share_key(self.ctx, agree(self._cipher_key, self.roster[item.sender].cipher_public), item.sender,
                            self.site)
        except ValueError:
            key = b""
        held = open_sealed(self.ctx, key, item.sender, self.site, item.ciphertext) if key else None
        if held is None:
            self._refuse(item.sender, msg.BAD_SHARE, "the sealed share does not open (altered, replayed, or "
                         "sealed for another round or site)")
        elif held.index != graph.share_index(item.sender, self.site):
            self._refuse(item.sender, msg.BAD_SHARE, f"share index {held.index}, the graph gives "
                         f"{graph.share_index(item.sender, self.site)}")
        else:
            self.held[item.sender] = held

    # -- round 3 ------------------------------------------------------------------------------------------
    def unmask(self, request: msg.UnmaskRequest) -> msg.UnmaskAnswer:
        """The shares the PS asked for: seeds of survivors, mask keys of dropped sites, among held ones."""
        if self._answered is not None:
            if request == self._answered[0]:
                return self._answered[1]
            raise SecAggRefused(msg.REFUSED_REQUEST, "a second, different unmasking request: answering it could "
                                "reveal both secrets of a neighbour")
        self._expect("masked")
        graph = self._graph()
        survivors, dropped = set(request.survivors), set(request.dropped)
        if len(survivors) != len(request.survivors) or len(dropped) != len(request.dropped):
            raise SecAggRefused(msg.REFUSED_REQUEST, "a site is named twice")
        if survivors & dropped:
            raise SecAggRefused(msg.REFUSED_REQUEST, f"{sorted(survivors & dropped)} named both surviving and "
                                "dropped: their updates would be revealed")
        if not (survivors | dropped) <= self.sites:
            raise SecAggRefused(msg.REFUSED_REQUEST, "the request names sites outside the roster")
        if self.site not in survivors:
            raise SecAggRefused(msg.REFUSED_REQUEST, "this site is not among the survivors")
        if len(survivors) < graph.params.threshold:
            raise SecAggRefused(msg.REFUSED_REQUEST, f"{len(survivors)} survivors, fewer than the threshold "
                                f"{graph.params.threshold}")
        answer = msg.UnmaskAnswer(
            self.site,
            seed_shares={o: (h.index, h.seed_share) for o, h in sorted(self.held.items()) if o in survivors},
            mask_key_shares={o: (h.index, h.mask_key_share) for o, h in sorted(self.held.items()) if o in dropped})
        self._answered = (request, answer)
        self.stage = "answered"
        return answer

    # -- helpers ------------------------------------------------------------------------------------------
    def _expect(self, stage: str) -> None:
        if self.stage != stage:
            raise SecAggRefused(msg.WRONG_STAGE, f"asked for the step after {stage!r}, but this site is at "
                                f"{self.stage!r}")

    def _graph(self) -> Graph:
        if self.graph is None:
            raise SecAggRefused(msg.WRONG_STAGE, "no roster yet")
        return self.graph

    def _refuse(self, party: str, category: str, reason: str) -> None:
        self.refusals.append(msg.Refusal(party, category, reason))

