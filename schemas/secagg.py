"""The message kinds of secure aggregation (docs/secure-aggregation.md, "Wire messages"), one per step.

They are part of `schemas.messages.Message` (the union the codec decodes); the channel's KINDS_BY_TOPIC says on
which topic each travels (fedmqtt/transport/channel.py), and docs/protocol.md lists them. Every
field is bounded, like every other kind: ids by pattern, keys and shares by exact length, lists by the most a
round can hold. A masked vector travels as an int32 or int64 tensor blob: the ring element's bits, read as two's
complement (so no float checks apply and no bit is lost).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from schemas.base import ID_PATTERN, MAX_SITES, Frozen, Header
from schemas.signed import Signature
from schemas.tensors import MAX_TENSOR_NAME, TensorBlob

KEY_BYTES = 32  # an X25519 public key, a SHA-256 commitment
SHARE_BYTES = 16  # a Shamir share of a 128-bit seed
SEALED_SHARE_BYTES = 2 + 2 * SHARE_BYTES + 16  # x-coordinate, two shares, the Poly1305 tag
MAX_NEIGHBOURS = 1024  # far above any degree the graph rule picks (42 at 10 000 sites, delta = 0.1)
MAX_LABEL_ROWS = 64  # output tensors summed label by label: a layer's weight and bias in practice
TensorName = Annotated[str, Field(min_length=1, max_length=MAX_TENSOR_NAME)]
MAX_SHARE_INDEX = 65_535  # two bytes in the sealed share
# The one scalar a site's update carries under secure aggregation (its tensors travel masked): how many coordinates
# of its weighted vector the ring's [-clip, clip] clipped, an integer from 0 to the vector's length. The PS warns
# and reports it; it learns that count and nothing else of the values.
CLIPPED_SCALAR = "secagg_clipped"

SiteId = Annotated[str, Field(pattern=ID_PATTERN)]
Attempt = Annotated[int, Field(ge=0, le=2**53)]
Key = Annotated[bytes, Field(min_length=KEY_BYTES, max_length=KEY_BYTES, strict=True)]
SiteIds = Annotated[tuple[SiteId, ...], Field(max_length=MAX_SITES)]
NeighbourIds = Annotated[tuple[SiteId, ...], Field(max_length=MAX_NEIGHBOURS)]


def _sorted_distinct(ids: tuple[str, ...], what: str) -> None:
    if list(ids) != sorted(set(ids)):
        raise ValueError(f"{what} must be sorted and distinct")


class DistributedDPTerms(Frozen):
    """Distributed differential privacy under secure aggregation (fedmqtt/secagg/skellam.py): each site clips its
    model change to L2 norm `clip`, encodes it and adds its share of Skellam noise in the ring, calibrated so that
    the sum of `expected_sites` sites carries noise of std noise_multiplier times the sensitivity."""

    mechanism: Literal["skellam"] = Field(default="skellam", description="the noise's distribution")
    clip: float = Field(gt=0, le=1e6, allow_inf_nan=False, description="C: the L2 norm a site's model change is "
                        "clipped to before it is encoded")
    noise_multiplier: float = Field(gt=0, le=1e4, allow_inf_nan=False, description="z: the noise on the sum of "
                                    "expected_sites sites has std z times the sensitivity")
    expected_sites: int = Field(ge=1, le=MAX_SITES, description="the sites the noise is calibrated for: each adds "
                                "1 / expected_sites of the variance")
    count_stddev: float = Field(default=0.0, ge=0, le=1e6, allow_inf_nan=False, description="adaptive clipping "
                                "(Andrew et al.): > 0, each site also sends b - 1/2 in the vector's last slot (b = 1 "
                                "when its change's norm was within `clip`) with Skellam noise, so that the sum of "
                                "expected_sites sites' count carries noise of this std (in sites); noise_multiplier "
                                "is then the change's share z_D of the run's z")


class SecAggTerms(Frozen):
    """What a train task under secure aggregation tells its site: the ring it encodes its update into, the most
    sites the ring was sized for, and the dropout fraction the round's graph is built for (docs/secure-aggregation.md,
    "Encoding" and "The graph and its parameters"). The site checks the ring again when it builds it."""

    ring_bits: Literal[32, 64] = Field(description="the ring Z_(2^bits) the masked sum lives in")
    fraction_bits: int = Field(ge=0, le=52, description="scale = 2^fraction_bits")
    clip: float = Field(gt=0, le=1e15, allow_inf_nan=False, description="every coordinate is clipped to "
                        "[-clip, clip] before it is encoded")
    max_sites: int = Field(ge=3, le=MAX_SITES, description="the most encodings the ring may have to sum")
    dropout: float = Field(ge=0, lt=0.5, allow_inf_nan=False, description="the fraction of sites the round's "
                           "graph is built to lose")
    attempt: Attempt = Field(default=0, description="which try of the round: every secure-aggregation message of "
                             "the round names it, and every secret is bound to it")
    weight_bound: float = Field(default=1.0, gt=0, le=1e15, allow_inf_nan=False, description="B: a site sends its "
                                "tensors times p_i = min(n_i / B, 1), then p_i (fedmqtt/secagg/weighted.py)")
    variates: bool = Field(default=False, description="the rule also sums control-variate deltas (SCAFFOLD): after "
                           "p_i the site appends p_i times its delta_c for every float tensor, zeros where it has none")
    normalised: bool = Field(default=False, description="the rule needs the updates over the local work (FedNova): "
                             "after p_i the site appends its float tensors times p_i / a_i, then p_i a_i, p_i tau_i "
                             "and p_i / a_i (fedmqtt/secagg/weighted.py)")
    work_bound: float = Field(default=1.0, gt=0, le=1e15, allow_inf_nan=False, description="W: with `normalised`, "
                              "the most local work a_i a site may report; it sends p_i a_i / W and p_i tau_i / W")
    uniform: bool = Field(default=False, description="the rule needs the plain mean of the updates (FedFBN, "
                          "FedDyn): every site weighs by 1, not by its sample count, so p_i = 1 / B with B the "
                          "number of selected sites, and the PS unmasks the plain mean and how many sites it holds")
    per_label_tensors: tuple[TensorName, ...] = Field(
        default=(), max_length=MAX_LABEL_ROWS,
        description="with `uniform`, the output tensors the rule averages label by label (FedFBN surgical): row r is "
        "masked times 1 if the site annotates label r, else 0, and those zeros and ones end the vector "
        "(fedmqtt/secagg/weighted.py)")
    distributed_dp: DistributedDPTerms | None = Field(default=None, description="DP-FedAvg's noise added by the "
                                                      "sites in the ring (distributed DP); the site sends its clipped "
                                                      "model change instead of p_i times its model")

    @model_validator(mode="after")
    def _per_label_tensors_with_the_plain_mean(self) -> SecAggTerms:
        if self.per_label_tensors and (not self.uniform or self.variates or self.normalised
                                or self.distributed_dp is not None):
            raise ValueError("per_label_tensors go only with the plain mean (uniform), without variates, normalised "
                             "updates or distributed DP")
        return self


class KeyAdvertBody(Frozen):
    """A site's two public keys and seed commitment, with its own Ed25519 signature over them and the round."""

    site: SiteId
    cipher_public: Key
    mask_public: Key
    seed_commitment: Key
    signature: Signature

    @model_validator(mode="after")
    def _signed_by_its_site(self) -> KeyAdvertBody:
        if self.signature.signer != self.site:
            raise ValueError("an advertisement is signed by its own site")
        return self


class SealedShare(Frozen):
    """A sealed pair of shares, with the other end: the receiver on the way to the PS, the sender on the way out."""

    peer: SiteId
    sealed: bytes = Field(min_length=SEALED_SHARE_BYTES, max_length=SEALED_SHARE_BYTES, strict=True)


class ShareAnswer(Frozen):
    """One revealed share: whose secret, the x-coordinate, the 16 bytes."""

    owner: SiteId
    index: int = Field(ge=1, le=MAX_SHARE_INDEX)  # the share's x-coordinate (the holder's place in the graph)
    share: bytes = Field(min_length=SHARE_BYTES, max_length=SHARE_BYTES, strict=True)


def _peers_distinct(shares: tuple[SealedShare, ...] | tuple[ShareAnswer, ...], what: str) -> None:
    owners = [s.peer if isinstance(s, SealedShare) else s.owner for s in shares]
    _sorted_distinct(tuple(owners), what)


class SecAggAdvert(Header):
    """Site -> PS, step 0: this round's keys."""

    kind: Literal["secagg_advert"] = "secagg_advert"
    attempt: Attempt = 0  # the try of the round (SecAggTerms.attempt)
    advert: KeyAdvertBody

    @model_validator(mode="after")
    def _own(self) -> SecAggAdvert:
        if self.advert.site != self.sender:
            raise ValueError("a site advertises its own keys only")
        return self


class SecAggRoster(Header):
    """PS -> one site, step 1: every site that advertised, and the advertisements of its neighbours and its own."""

    kind: Literal["secagg_roster"] = "secagg_roster"
    attempt: Attempt = 0  # the try of the round (SecAggTerms.attempt)
    site_id: SiteId
    sites: SiteIds
    adverts: Annotated[tuple[KeyAdvertBody, ...], Field(max_length=MAX_NEIGHBOURS + 1)]

    @model_validator(mode="after")
    def _consistent(self) -> SecAggRoster:
        _sorted_distinct(self.sites, "sites")
        names = tuple(a.site for a in self.adverts)
        _sorted_distinct(names, "adverts (by site)")
        if self.site_id not in names or not set(names) <= set(self.sites):
            raise ValueError("the roster carries its receiver's advertisement and only rostered sites'")
        return self


class SecAggShares(Header):
    """Site -> PS, step 1: a sealed share for each neighbour (peer = receiver)."""

    kind: Literal["secagg_shares"] = "secagg_shares"
    attempt: Attempt = 0  # the try of the round (SecAggTerms.attempt)
    shares: Annotated[tuple[SealedShare, ...], Field(min_length=1, max_length=MAX_NEIGHBOURS)]

    @model_validator(mode="after")
    def _distinct(self) -> SecAggShares:
        _peers_distinct(self.shares, "shares (by receiver)")
        if any(s.peer == self.sender for s in self.shares):
            raise ValueError("a site shares with its neighbours, not with itself")
        return self


class SecAggInbox(Header):
    """PS -> one site, step 1: the sealed shares its sharing neighbours addressed to it (peer = sender)."""

    kind: Literal["secagg_inbox"] = "secagg_inbox"
    attempt: Attempt = 0  # the try of the round (SecAggTerms.attempt)
    site_id: SiteId
    shares: Annotated[tuple[SealedShare, ...], Field(max_length=MAX_NEIGHBOURS)]

    @model_validator(mode="after")
    def _distinct(self) -> SecAggInbox:
        _peers_distinct(self.shares, "shares (by sender)")
        return self


class SecAggMasked(Header):
    """Site -> PS, step 2: the masked encoding of the update (chunked like an update) and whom it paired with."""

    kind: Literal["secagg_masked"] = "secagg_masked"
    attempt: Attempt = 0  # the try of the round (SecAggTerms.attempt)
    ring_bits: Literal[32, 64]
    fraction_bits: int = Field(ge=0, le=52)
    clip: float = Field(gt=0, le=1e15, allow_inf_nan=False)
    masked: TensorBlob
    paired_with: NeighbourIds

    @model_validator(mode="after")
    def _ring_vector(self) -> SecAggMasked:
        expected = "int32" if self.ring_bits == 32 else "int64"
        if self.masked.dtype != expected or len(self.masked.shape) != 1:
            raise ValueError(f"a masked vector is a flat {expected} tensor (the ring's bits, two's complement)")
        _sorted_distinct(self.paired_with, "paired_with")
        return self


class SecAggUnmask(Header):
    """PS -> each survivor, step 3: whose seeds (survivors) and whose mask keys (dropped) to reveal.

    It travels on each survivor's own task topic (site_id names it), every survivor receiving the same lists."""

    kind: Literal["secagg_unmask"] = "secagg_unmask"
    attempt: Attempt = 0  # the try of the round (SecAggTerms.attempt)
    site_id: SiteId
    survivors: SiteIds
    dropped: SiteIds

    @model_validator(mode="after")
    def _disjoint(self) -> SecAggUnmask:
        _sorted_distinct(self.survivors, "survivors")
        _sorted_distinct(self.dropped, "dropped")
        if set(self.survivors) & set(self.dropped):
            raise ValueError("no site is both a survivor and dropped")
        return self


class SecAggAnswer(Header):
    """Survivor -> PS, step 3: the shares asked of it."""

    kind: Literal["secagg_answer"] = "secagg_answer"
    attempt: Attempt = 0  # the try of the round (SecAggTerms.attempt)
    seed_shares: Annotated[tuple[ShareAnswer, ...], Field(max_length=MAX_NEIGHBOURS)]
    mask_key_shares: Annotated[tuple[ShareAnswer, ...], Field(max_length=MAX_NEIGHBOURS)]

    @model_validator(mode="after")
    def _distinct(self) -> SecAggAnswer:
        _peers_distinct(self.seed_shares, "seed_shares (by owner)")
        _peers_distinct(self.mask_key_shares, "mask_key_shares (by owner)")
        if {s.owner for s in self.seed_shares} & {s.owner for s in self.mask_key_shares}:
            raise ValueError("never both shares of one site")
        return self
