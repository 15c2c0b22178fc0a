"""The PS's side of a secure aggregation round, as a state object with one method a step (no I/O, no clock).

receive_* take one party's message and return a `Refusal` or None; close_* end a stage (at its deadline, or once
everyone answered) and return what the PS sends next, or `RoundFailed`. Every refusal is kept (`refusals`) with
its party, category and reason. A party that equivocates (two different messages for one step) or that a
neighbour accuses of a missing or bad share leaves the round; its masks are removed as a dropped site's are.

What the PS holds at any time: public keys, sealed shares it cannot open, masked vectors (uniform in the ring on
their own), the shares the survivors reveal (self-mask seeds of survivors, mask keys of dropped sites, never both
for one site) and the sum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping
from functools import partial
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedmqtt.errors import ConfigError
from fedmqtt.secagg import messages as msg
from fedmqtt.secagg.adverts import Verifier, check_advert, public_raw
from fedmqtt.secagg.context import RoundContext
from fedmqtt.secagg.graph import DEFAULT_FAILURE_BITS, Graph, build, choose
from fedmqtt.secagg.kdf import mask_private_key, seed_commitment
from fedmqtt.secagg.masks import pair_mask, self_mask
from fedmqtt.secagg.ring import FixedPoint
from fedmqtt.secagg.sealing import SEALED_BYTES
from fedmqtt.secagg.shamir import SHARE_BYTES, Reconstruction, reconstruct

MIN_SITES = 3  # with two, each learns the other's update from the sum


class ServerSession:
    """One round's secure aggregation at the PS."""

    def __init__(self, ctx: RoundContext, selected: Iterable[str], verifier: Verifier, fixed: FixedPoint,
                 length: int, *, dropout: float, failure_bits: int = DEFAULT_FAILURE_BITS) -> None:
        self.ctx, self.verifier, self.fixed, self.length = ctx, verifier, fixed, length
        self.dropout, self.failure_bits = dropout, failure_bits
        self.selected = frozenset(selected)
        if len(self.selected) > fixed.max_sites:
            raise ConfigError(f"{len(self.selected)} sites selected, but the ring is sized for {fixed.max_sites}")
        choose(max(len(self.selected), MIN_SITES), dropout, failure_bits=failure_bits)  # refuses a bad dropout now
        self.stage = "keys"
        self.refusals: list[msg.Refusal] = []
        self.banned: set[str] = set()
        self.adverts: dict[str, msg.KeyAdvert] = {}
        self.graph: Graph | None = None
        self.bundles: dict[str, msg.ShareBundle] = {}
        self.sharing: frozenset[str] = frozenset()  # U2: sites whose shares went out
        self.masked: dict[str, msg.MaskedInput] = {}
        self.request: msg.UnmaskRequest | None = None
        self.paired: dict[str, frozenset[str]] = {}
        self.answers: dict[str, msg.UnmaskAnswer] = {}
        self.outcome: msg.RoundSum | msg.RoundFailed | None = None

    # -- round 0: keys ------------------------------------------------------------------------------------
    def receive_advert(self, advert: msg.KeyAdvert) -> msg.Refusal | None:
        site = advert.site
        if (refused := self._gate(site, "keys", self.selected)) is not None:
            return refused
        if site in self.adverts:
            return self._duplicate(site, self.adverts[site] == advert, self.adverts)
        problem = check_advert(self.ctx, advert, self.verifier)
        if problem is not None:
            return self._refuse(site, *problem)
        self.adverts[site] = advert
        return None

    def close_adverts(self) -> dict[str, msg.Roster] | msg.RoundFailed:
        """Each advertised site's roster (every site's id, its neighbours' advertisements), or a failure."""
        self._expect("keys")
        if len(self.adverts) < MIN_SITES:
            return self._fail(f"{len(self.adverts)} sites advertised keys, {MIN_SITES} needed")
        graph = self.graph = build(self.ctx, self.adverts, self.dropout, failure_bits=self.failure_bits)
        self.stage = "shares"
        sites = tuple(sorted(self.adverts))
        return {site: msg.Roster(sites, tuple(self.adverts[s] for s in sorted({site, *graph.neighbours[site]})))
                for site in sites}

    # -- round 1: shares ----------------------------------------------------------------------------------
    def receive_shares(self, bundle: msg.ShareBundle) -> msg.Refusal | None:
        site = bundle.sender
        if (refused := self._gate(site, "shares", self.adverts)) is not None:
            return refused
        if site in self.bundles:
            return self._duplicate(site, self.bundles[site] == bundle, self.bundles)
        neighbours = self._graph().neighbours[site]
        receivers = tuple(s.receiver for s in bundle.shares)
        if receivers != neighbours or any(s.sender != site for s in bundle.shares):
            return self._refuse(site, msg.MALFORMED, f"shares for {list(receivers)}, its neighbours are "
                                f"{list(neighbours)}")
        if any(len(s.ciphertext) != SEALED_BYTES for s in bundle.shares):
            return self._refuse(site, msg.MALFORMED, f"a sealed share is not {SEALED_BYTES} bytes")
        self.bundles[site] = bundle
        return None

    def close_shares(self) -> dict[str, list[msg.EncryptedShare]] | msg.RoundFailed:
        """Each sharing site's inbox: the sealed shares its sharing neighbours addressed to it."""
        self._expect("shares")
        graph = self._graph()
        sharing = set(self.bundles) - self.banned
        t = graph.params.threshold
        while True:  # a site with fewer than t sharing neighbours could never have its secrets rebuilt
            short = {s for s in sharing if len(set(graph.neighbours[s]) & sharing) < t}
            if not short:
                break
            for site in sorted(short):
                self._refuse(site, msg.UNKNOWN_PARTY, f"fewer than {t} of its neighbours shared keys")
            sharing -= short
        if len(sharing) < MIN_SITES:
            return self._fail(f"{len(sharing)} sites shared keys, {MIN_SITES} needed")
        self.sharing = frozenset(sharing)
        self.stage = "masked"
        inbox: dict[str, list[msg.EncryptedShare]] = {s: [] for s in sorted(sharing)}
        for sender in sorted(sharing):
            for sealed in self.bundles[sender].shares:
                if sealed.receiver in sharing:
                    inbox[sealed.receiver].append(sealed)
        return inbox

    # -- round 2: masked inputs ---------------------------------------------------------------------------
    def receive_masked(self, masked: msg.MaskedInput) -> msg.Refusal | None:
        site = masked.sender
        if (refused := self._gate(site, "masked", self.sharing)) is not None:
            return refused
        if site in self.masked:
            same = (self.masked[site].paired_with == masked.paired_with
                    and np.array_equal(self.masked[site].masked, masked.masked))
            return self._duplicate(site, same, self.masked)
        vector = masked.masked
        if not isinstance(vector, np.ndarray) or vector.dtype != self.fixed.dtype or vector.shape != (self.length,):
            return self._refuse(site, msg.MALFORMED, f"a masked input must be {self.fixed.dtype.__name__} of shape "
                                f"({self.length},)")
        allowed = set(self._graph().neighbours[site]) & self.sharing
        paired = masked.paired_with
        if list(paired) != sorted(set(paired)) or not set(paired) <= allowed:
            return self._refuse(site, msg.MALFORMED, "paired_with must be sorted, distinct sharing neighbours")
        self.masked[site] = masked
        return None

    def close_masked(self) -> msg.UnmaskRequest | msg.RoundFailed:
        """Whom to unmask how: the survivors' seeds and the dropped sites' mask keys, or a failure."""
        self._expect("masked")
        graph = self._graph()
        t = graph.params.threshold
        candidates = set(self.masked) - self.banned
        accused = set()
        for site in sorted(candidates):
            for other in sorted(set(graph.neighbours[site]) & self.sharing - set(self.masked[site].paired_with)):
                accused.add(other)
                self._refuse(other, msg.ACCUSED, f"{site!r} got no share from it that opened")
        survivors = candidates - accused
        self.paired = {s: frozenset(self.masked[s].paired_with) for s in survivors}
        dropped = {j for s in survivors for j in self.paired[s]} - survivors
        if len(survivors) < max(MIN_SITES, t):
            return self._fail(f"{len(survivors)} sites sent usable masked inputs, {max(MIN_SITES, t)} needed")
        for owner in sorted(survivors | dropped):
            holders = self._holders(owner, survivors)
            if len(holders) < t:
                what = "self-mask" if owner in survivors else "pairwise masks"
                return self._fail(f"{owner!r}'s {what} cannot be removed: {len(holders)} of its neighbours hold "
                                  f"its shares, {t} needed")
        if not _connected(survivors, self.paired):
            return self._fail("the survivors' masks fall apart into groups: unmasking would reveal each group's sum")
        self.request = msg.UnmaskRequest(tuple(sorted(survivors)), tuple(sorted(dropped)))
        self.stage = "unmask"
        return self.request

    # -- round 3: unmasking -------------------------------------------------------------------------------
    def receive_answer(self, answer: msg.UnmaskAnswer) -> msg.Refusal | None:
        site = answer.sender
        if (refused := self._gate(site, "unmask", self.paired)) is not None:
            return refused
        request = self._request()
        if site in self.answers:
            return self._duplicate(site, self.answers[site] == answer, self.answers)
        held = self.paired[site]
        graph = self._graph()
        expected = ({o for o in request.survivors if o in held}, {o for o in request.dropped if o in held})
        if (set(answer.seed_shares), set(answer.mask_key_shares)) != expected:
            return self._refuse(site, msg.MALFORMED, "the answer does not cover exactly the shares asked of it")
        for owner, (index, share) in [*answer.seed_shares.items(), *answer.mask_key_shares.items()]:
            if index != graph.share_index(owner, site) or len(share) != SHARE_BYTES:
                return self._refuse(site, msg.MALFORMED, f"its share of {owner!r} has a wrong index or size")
        self.answers[site] = answer
        return None

    def finish(self) -> msg.RoundSum | msg.RoundFailed:
        """Rebuild the secrets from the answers so far and return the sum (or why it cannot be had)."""
        self._expect("unmask")
        request, t = self._request(), self._graph().params.threshold
        answers = {s: a for s, a in self.answers.items() if s not in self.banned}
        seeds: dict[str, bytes] = {}
        for owner in request.survivors:
            commitment = self.adverts[owner].seed_commitment
            found = self._rebuild(owner, {h: a.seed_shares[owner] for h, a in answers.items()
                                          if owner in a.seed_shares}, t,
                                  partial(_commits_to, self.ctx, owner, commitment))
            if found.secret is None:
                return self._fail(f"{owner!r}'s self-mask seed could not be rebuilt: {found.reason}")
            seeds[owner] = found.secret
        keys: dict[str, X25519PrivateKey] = {}
        for owner in request.dropped:
            public = self.adverts[owner].mask_public
            found = self._rebuild(owner, {h: a.mask_key_shares[owner] for h, a in answers.items()
                                          if owner in a.mask_key_shares}, t,
                                  partial(_opens, self.ctx, owner, public))
            if found.secret is None:
                return self._fail(f"{owner!r}'s mask key could not be rebuilt: {found.reason}")
            keys[owner] = mask_private_key(self.ctx, found.secret, owner)
        dtype, n = self.fixed.dtype, self.length
        total = self.fixed.zeros(n)
        for site in request.survivors:
            total = total + self.masked[site].masked - self_mask(self.ctx, seeds[site], site, n, dtype)
        for gone, key in keys.items():
            for site in request.survivors:
                if gone in self.paired[site]:  # y_site carries sign(site, gone) * PRG(s): that is -sign(gone, site)
                    total = total + pair_mask(self.ctx, key, gone, self.adverts[site].mask_public, site, n, dtype)
        self.stage = "done"
        self.outcome = msg.RoundSum(self.fixed.decode_sum(total.astype(dtype, copy=False)), request.survivors,
                                    request.dropped, tuple(self.refusals))
        return self.outcome

    def _rebuild(self, owner: str, shares: dict[str, tuple[int, bytes]], t: int,
                 check: Callable[[bytes], bool]) -> Reconstruction:
        result = reconstruct(shares, t, check)
        for holder in result.bad_holders:
            self._refuse(holder, msg.INCONSISTENT_SHARE, f"its share of {owner!r} is off the polynomial")
        return result

    # -- helpers ------------------------------------------------------------------------------------------
    def _holders(self, owner: str, survivors: set[str]) -> list[str]:
        return [h for h in sorted(survivors) if owner in self.paired[h]]

    def _gate(self, site: str, stage: str, members: Iterable[str]) -> msg.Refusal | None:
        if self.stage != stage:
            return self._refuse(site, msg.WRONG_STAGE, f"a {stage} message while the round is at {self.stage}")
        if site in self.banned or site not in set(members):
            return self._refuse(site, msg.UNKNOWN_PARTY, f"not a party of the {stage} stage")
        return None

    def _duplicate(self, site: str, same: bool, store: MutableMapping[str, Any]) -> msg.Refusal:
        if same:
            return self._refuse(site, msg.REPLAY, "the same message again (ignored)")
        store.pop(site, None)
        self.banned.add(site)
        return self._refuse(site, msg.EQUIVOCATION, "a second, different message for the same step: out of the "
                            "round")

    def _refuse(self, party: str, category: str, reason: str) -> msg.Refusal:
        refusal = msg.Refusal(party, category, reason)
        self.refusals.append(refusal)
        return refusal

    def _fail(self, reason: str) -> msg.RoundFailed:
        self.stage = "failed"
        self.outcome = msg.RoundFailed(reason, tuple(self.refusals))
        return self.outcome

    def _expect(self, stage: str) -> None:
        if self.stage != stage:
            raise RuntimeError(f"secure aggregation: step of stage {stage!r} called at stage {self.stage!r}")

    def _graph(self) -> Graph:
        if self.graph is None:
            raise RuntimeError("secure aggregation: no graph before the keys are closed")
        return self.graph

    def _request(self) -> msg.UnmaskRequest:
        if self.request is None:
            raise RuntimeError("secure aggregation: no unmasking request yet")
        return self.request


def _commits_to(ctx: RoundContext, owner: str, commitment: bytes, seed: bytes) -> bool:
    return seed_commitment(ctx, seed, owner) == commitment


def _opens(ctx: RoundContext, owner: str, public: bytes, mask_seed: bytes) -> bool:
    return public_raw(mask_private_key(ctx, mask_seed, owner)) == public


def _connected(sites: set[str], edges: dict[str, frozenset[str]]) -> bool:
    """Whether the survivors form one group through their pairwise masks with each other."""
    if not sites:
        return False
    start = min(sites)
    seen, frontier = {start}, [start]
    while frontier:
        site = frontier.pop()
        for other in edges[site] & sites:
            if other not in seen:
                seen.add(other)
                frontier.append(other)
    return seen == sites
